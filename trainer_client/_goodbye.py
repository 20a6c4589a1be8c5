"""A worker that ends cleanly tells its node daemons so, and is not listed as a failure.

A daemon learns that a worker exited when the worker's connections close and its pid is gone; it
cannot see the exit code (the worker is not its child), so a job's normal end used to be listed
under "recent failures" (status page, ``ffplane status``, ``/v1/cluster``), one line per worker.
At interpreter exit, with no unhandled exception, this process sends ``bye`` to every daemon it
connected to, on a connection of its own (a Checkpointer's or DataLoader's may be mid-request on
another thread) and waits for the answer, so the daemon knows before the process is gone. A
process killed by a signal, ended by ``os._exit`` or by an unhandled exception sends nothing and
is reported as before. The interpreter does not tell exit hooks the code of a ``sys.exit(N)``:
such an end counts as clean (torchrun then stops the worker's peers, whose exits are listed).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ffplane_contract.control import Bye, Request
from ffplane_contract.errors import FFPlaneError

__all__ = ["watch"]

log = logging.getLogger(__name__)

_BYE_TIMEOUT_S = 1.0  # per daemon, at exit: a daemon that hangs must not hold the process up


class _Connection(Protocol):
    def call(self, msg: Request) -> Any: ...

    def close(self) -> None: ...


# (socket path, timeout_s) → a new connection to that daemon; raises FFPlaneError if none answers
_Connect = Callable[[Path, float], _Connection]

_lock = threading.Lock()
# the daemons this process connected to, each with how to connect to it again (the caller's
# client class: this module imports no client, which imports it)
_sockets: dict[Path, _Connect] = {}
_registered_pid = 0  # the process whose exit hook is registered (a forked child registers its own)


def watch(socket_path: Path, connect: _Connect) -> None:
    """Say ``bye`` to the daemon at ``socket_path`` when this process ends cleanly, on a
    connection of its own made by ``connect``."""
    global _registered_pid
    with _lock:
        if _registered_pid != os.getpid():  # first connection of this process (or of a forked child)
            _sockets.clear()
            _registered_pid = os.getpid()
            atexit.register(_say_bye, _registered_pid)
        _sockets[Path(socket_path)] = connect


def _crashed() -> bool:
    """Whether an unhandled exception is ending the interpreter (it sets these before exit hooks)."""
    return getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None


def _say_bye(pid: int) -> None:
    if pid != os.getpid() or _crashed():
        return  # a forked child that never connected itself, or a crash: nothing to say
    with _lock:
        sockets = sorted(_sockets.items())
        _sockets.clear()  # once, even if the hook were run twice
    for path, connect in sockets:
        try:
            client = connect(path, _BYE_TIMEOUT_S)
        except FFPlaneError:
            continue  # the daemon is gone: it reports nothing either
        try:
            client.call(Bye())
        except FFPlaneError as exc:  # an older daemon answers 'unknown op': this exit is listed as before
            log.debug("bye to %s not taken: %s", path, exc)
        finally:
            client.close()
