"""Shared-memory discipline for files other processes may have mapped.

Peers break on three things, so this module owns them:

* a published segment is never truncated or rewritten — a reader with a live mapping would take
  SIGBUS or see torn bytes. New content is written to a temporary name and published with
  ``rename`` (atomic on one filesystem); eviction is ``unlink``, which leaves existing mappings
  valid until their owners drop them;
* temporary files of a writer that died are reclaimed at start-up (one daemon per root, enforced
  with a lock, so every temporary file found then is stale);
* the tmpfs must have room for the configured budget, checked before anything is written, because
  running out later surfaces as SIGBUS in a reader rather than as an error;
* what the daemon holds is the job's data and training state, so it is private to the user the
  daemon and the workers run as: every folder it creates is 0700 (``private_dir``) and every
  file 0600 (``PRIVATE_FILE``), in the root and in the durable tier. A folder the operator made
  (``--root``, ``--durable-dir`` when they exist already) keeps the mode it was given.

Page size matters too: a reader maps every cached step afresh, and on 4 KiB pages populating a
4 MiB mapping costs about as much as copying it. On a tmpfs mounted ``huge=within_size`` the
kernel backs a file with 2 MiB pages where the file already covers them, so writers set a file's
final size before writing it (``presize``); ``huge_pages`` tells the daemon which kind it has.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, TypeVar

from ffplane_contract.errors import CapacityError

TMP_MARK = ".tmp-"
HUGE_PAGE = 2 << 20
PRIVATE_FILE = 0o600  # mode of every file the daemon creates (before the umask, which only removes)
PRIVATE_DIR = 0o700  # and of every folder


class ShmError(RuntimeError):
    """The shared-memory root is unusable; the message says how to fix it."""


def private_dir(path: Path) -> Path:
    """``mkdir -p path`` where every folder it creates is 0700; folders that exist are left as
    they are (the operator's ``--root`` or ``--durable-dir``, or a parent of them). Returns ``path``."""
    missing: list[Path] = []
    p = path
    while not p.is_dir():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=PRIVATE_DIR)  # only the final component: parents=True would ignore mode
        except FileExistsError:
            if not d.is_dir():
                raise
    return path


def open_private(path: str | os.PathLike[str], flags: int) -> int:
    """``os.open`` that creates ``path`` 0600: an ``opener`` for ``open()`` too."""
    return os.open(path, flags, PRIVATE_FILE)


def acquire_root(root: Path) -> IO[bytes]:
    """Create ``root`` (0700, if missing) and hold its lock for the life of the process (one
    daemon per root)."""
    private_dir(root)
    lock = open(root / "daemon.lock", "ab", opener=open_private)  # noqa: SIM115 - held for the process life
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


def reserve(fd: int, size: int, what: str, root: Path | str) -> None:
    """Give ``fd`` its ``size`` and allocate every page now (``posix_fallocate``), or raise
    ``CapacityError`` naming ``what``, the root and what was needed: a write into pages a full
    tmpfs cannot back fails midway (a mapping's fault, a reset connection) instead of up front."""
    presize(fd, size)
    if size <= 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        raise no_room(what, size, root, exc) from exc


def no_room(what: str, size: int, root: Path | str, exc: BaseException) -> CapacityError:
    """The ``CapacityError`` for ``what`` (``size`` bytes) not fitting in the tmpfs at ``root``."""
    try:
        st = os.statvfs(root)
        free = f"{st.f_bavail * st.f_frsize / 2**20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    need = f"{size / 2**20:.1f} MiB" if size >= 1 << 20 else f"{size} bytes"
    return CapacityError(
        f"no room for {what} ({need}) in the tmpfs at {root} ({free}): {getattr(exc, 'strerror', None) or exc}; "
        "give the tmpfs more room or lower --budget-mb below its size"
    )


def huge_pages(root: Path) -> str:
    """The ``huge=`` mount option of the tmpfs holding ``root`` (``never`` if none or not tmpfs)."""
    fs_type, options = filesystem(root)
    huge = [o.removeprefix("huge=") for o in options.split(",") if o.startswith("huge=")]
    return huge[0] if fs_type == "tmpfs" and huge else "never"


def filesystem(root: Path) -> tuple[str, str]:
    """(type, super options) of the mount holding ``root`` or, before it exists, its parent."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return "unknown", ""
    best, found = -1, ("unknown", "")
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
            best, found = len(mount_point), (fs_type, super_opts)
    return found


_P = TypeVar("_P", Path, str)


def tmp_path(final: _P) -> _P:
    """Where ``final`` is written before its rename (reclaimed at start-up if a crash leaves it);
    a string for a string (the per-save paths are strings: see ``index.write_sidecar``)."""
    if isinstance(final, str):
        return f"{final}{TMP_MARK}{os.getpid()}"
    return final.with_name(f"{final.name}{TMP_MARK}{os.getpid()}")


class PageWriter:
    """Writes a stream of chunks to ``fd`` from ``offset`` on, in pieces that end on 2 MiB
    boundaries.

    The first write into a fresh tmpfs page zeroes whatever of the page it does not cover
    (``shmem_write_end``), so writing a new file 1 MiB at a time made the kernel zero half of
    every 2 MiB page before the next write filled it: 8 % of the daemon's CPU per cached step
    (``perf`` of an end-to-end read). Writes that fill huge pages from their start leave nothing
    to zero but the file's last page. ``on_write`` sees every byte once it is written, in order
    (a replica hashes what it has, not what it was sent).
    """

    def __init__(self, fd: int, offset: int = 0, on_write: Callable[[memoryview], None] | None = None) -> None:
        self.fd = fd
        self.offset = offset  # every byte before this file offset is written
        self._pending: list[memoryview] = []
        self._pending_bytes = 0
        self._on_write = on_write

    def add(self, chunk: bytes | memoryview) -> None:
        self._pending.append(memoryview(chunk))
        self._pending_bytes += len(chunk)
        end = self.offset + self._pending_bytes
        if end // HUGE_PAGE > self.offset // HUGE_PAGE:
            self._write(end // HUGE_PAGE * HUGE_PAGE - self.offset)

    def flush(self) -> None:
        """Write whatever is pending (the file's tail, or a body cut off midway)."""
        self._write(self._pending_bytes)

    def _write(self, nbytes: int) -> None:
        views: list[memoryview] = []
        rest: list[memoryview] = []
        left = nbytes
        for v in self._pending:
            if left >= len(v):
                views.append(v)
                left -= len(v)
            elif left:
                views.append(v[:left])
                rest.append(v[left:])
                left = 0
            else:
                rest.append(v)
        while views:  # short writes happen; ENOSPC raises with the unwritten part still pending
            n = os.pwritev(self.fd, views, self.offset)
            self.offset += n
            self._pending_bytes -= n
            while views and n >= len(views[0]):
                n -= len(views[0])
                self._written(views.pop(0))
            if views and n:
                self._written(views[0][:n])
                views[0] = views[0][n:]
            self._pending = views + rest
        self._pending = rest

    def _written(self, view: memoryview) -> None:
        if self._on_write is not None:
            self._on_write(view)


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


def unlink(path: Path | str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
