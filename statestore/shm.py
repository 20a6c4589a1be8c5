"""Shared-memory discipline for files other processes may have mapped.

Peers break on three things, so this module owns them:

* a published segment is never truncated or rewritten — a reader with a live mapping would take
  SIGBUS or see torn bytes. New content is written to a temporary name and published with
  ``rename`` (atomic on one filesystem); eviction is ``unlink``, which leaves existing mappings
  valid until their owners drop them;
* temporary files of a writer that died are reclaimed at start-up (one daemon per root, enforced
  with a lock, so every temporary file found then is stale);
* the tmpfs must have room for the configured budget, checked before anything is written, because
  running out later surfaces as SIGBUS in a reader rather than as an error.

Page size matters too: a reader maps every cached step afresh, and on 4 KiB pages populating a
4 MiB mapping costs about as much as copying it. On a tmpfs mounted ``huge=within_size`` the
kernel backs a file with 2 MiB pages where the file already covers them, so writers set a file's
final size before writing it (``presize``); ``huge_pages`` tells the daemon which kind it has.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

TMP_MARK = ".tmp-"


class ShmError(RuntimeError):
    """The shared-memory root is unusable; the message says how to fix it."""


def acquire_root(root: Path) -> IO[bytes]:
    """Create ``root`` and hold its lock for the life of the process (one daemon per root)."""
    root.mkdir(parents=True, exist_ok=True)
    lock = open(root / "daemon.lock", "ab")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        lock.close()
        raise ShmError(f"another statestore daemon already uses {root}; stop it or pick another --root") from exc
    return lock


def check_room(root: Path, budget_bytes: int, already_ours: int = 0) -> None:
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    if free + already_ours < budget_bytes:
        mib = 1 << 20
        raise ShmError(
            f"{root} has {free // mib} MiB free (+{already_ours // mib} MiB already ours) but the "
            f"budget is {budget_bytes // mib} MiB. Lower --budget-mb, or give the tmpfs more room "
            "(Docker's default /dev/shm is 64 MB: run with --shm-size=8g, or in Kubernetes mount an "
            "emptyDir with medium: Memory and a sizeLimit)"
        )


def presize(fd: int, size: int) -> None:
    """Give a file about to be written its final size, so a ``huge=within_size`` tmpfs backs it
    with huge pages (appending writes would see a short file and get 4 KiB pages)."""
    if size > 0:
        os.ftruncate(fd, size)


def huge_pages(root: Path) -> str:
    """The ``huge=`` mount option of the tmpfs holding ``root`` (``never`` if none or not tmpfs)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return "never"
    best, option = -1, "never"
    target = str(root.resolve())
    for line in lines:
        fields = line.split()
        try:
            sep = fields.index("-")
        except ValueError:
            continue
        mount_point, fs_type, super_opts = fields[4], fields[sep + 1], fields[sep + 3] if len(fields) > sep + 3 else ""
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) > best:
            best = len(mount_point)
            huge = [o.removeprefix("huge=") for o in super_opts.split(",") if o.startswith("huge=")]
            option = huge[0] if fs_type == "tmpfs" and huge else "never"
    return option


def tmp_path(final: Path) -> Path:
    return final.with_name(f"{final.name}{TMP_MARK}{os.getpid()}")


def publish(tmp: Path, final: Path) -> None:
    """Make a fully written ``tmp`` visible as ``final`` in one step."""
    os.rename(tmp, final)


def reclaim_stale(root: Path) -> int:
    """Remove temporary files left by dead writers; returns how many."""
    n = 0
    for path in root.rglob(f"*{TMP_MARK}*"):
        if path.is_file():
            path.unlink(missing_ok=True)
            n += 1
    return n


def unlink(path: Path) -> None:
    path.unlink(missing_ok=True)
