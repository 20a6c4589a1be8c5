"""Names of the files a worker and its node daemon share: the control socket, published step
files, and the link-hint counters.

* The control socket is ``$FFPLANE_DAEMON_SOCKET``, by default ``/dev/shm/ffplane/daemon.sock``;
  the daemon's root is its folder.
* A cached step ``s`` of a reader's stream is published as ``<root>/<steps>/<s:012d>.arrow``
  (``steps`` as the ``open`` reply names it); published files never change.
* Each training process keeps its link hint in ``<root>/hints/<pid>``: 8 bytes, one
  little-endian int64, how many collectives the process has in flight.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

SOCKET_ENV = "FFPLANE_DAEMON_SOCKET"
SOCKET_NAME = "daemon.sock"
SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path (sun_path holds 108, its NUL included)
DEFAULT_ROOT = Path("/dev/shm/ffplane")
DEFAULT_SOCKET = DEFAULT_ROOT / SOCKET_NAME

HINTS_DIR = "hints"
HINT = struct.Struct("<q")


def socket_path(given: str | os.PathLike[str] | None = None) -> Path:
    """The control socket: ``given``, else ``$FFPLANE_DAEMON_SOCKET``, else the default."""
    return Path(given or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET)


def step_file(step: int) -> str:
    """The name a cached step is published under, in its stream's folder."""
    return f"{step:012d}.arrow"


def hint_path(root: Path, pid: int) -> Path:
    return root / HINTS_DIR / str(pid)
