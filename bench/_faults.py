"""Faults injected from outside a running process (root): a server that stops answering while it
keeps running, bytes flipped in a file, a digit changed in a header at rest, and a stranger's
traffic against a daemon's bulk port.

``unreachable(pid, port)`` makes a server's TCP port stop answering without stopping the process:
its heartbeats (outgoing) go on, so the coordinator still sees it alive — the case of a firewall
that drops inbound traffic, or a peer port bound where nobody can reach it. The listening socket
and every connection accepted on it are taken from the process (``pidfd_getfd``); the listener
gets a socket filter that drops every packet (a connect times out, as through a firewall), and
the accepted connections are shut down. ``heal`` lets packets through again.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import signal
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path

_PIDFD_GETFD = 438  # syscall number on x86-64 and arm64
_SO_ATTACH_FILTER = 26
_libc = ctypes.CDLL(None, use_errno=True)


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _filter(keep: bool) -> tuple[_Prog, ctypes.Array[ctypes.c_uint8]]:
    code = (ctypes.c_uint8 * 8).from_buffer_copy(struct.pack("HBBI", 0x06, 0, 0, 0xFFFFFFFF if keep else 0))  # BPF_RET|BPF_K
    return _Prog(1, ctypes.addressof(code)), code


def _sockets(pid: int, port: int) -> dict[str, list[int]]:
    """The process's TCP sockets on local ``port``: {"listen": [fd], "conn": [fd, ...]}."""
    states: dict[str, str] = {}
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if path.exists():
            for line in path.read_text().splitlines()[1:]:
                f = line.split()
                if int(f[1].rsplit(":", 1)[1], 16) == port:
                    states[f[9]] = "listen" if f[3] == "0A" else "conn"
    out: dict[str, list[int]] = {"listen": [], "conn": []}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in states:
            out[states[target[8:-1]]].append(int(fd))
    return out


def _take(pidfd: int, fd: int) -> int:
    dup = _libc.syscall(_PIDFD_GETFD, pidfd, fd, 0)
    if dup < 0:
        raise OSError(ctypes.get_errno(), f"pidfd_getfd of fd {fd} failed (needs root or ptrace rights)")
    return int(dup)


def _set_filter(pid: int, port: int, keep: bool) -> int:
    pidfd = os.pidfd_open(pid)
    prog, _code = _filter(keep)
    found = _sockets(pid, port)
    try:
        for fd in found["listen"]:
            dup = _take(pidfd, fd)
            try:
                if _libc.setsockopt(dup, socket.SOL_SOCKET, _SO_ATTACH_FILTER, ctypes.byref(prog), ctypes.sizeof(prog)) != 0:
                    raise OSError(ctypes.get_errno(), "SO_ATTACH_FILTER failed")
            finally:
                os.close(dup)
        if not keep:
            for fd in found["conn"]:
                dup = _take(pidfd, fd)
                try:
                    socket.socket(fileno=dup).shutdown(socket.SHUT_RDWR)  # the socket object owns dup now
                except OSError:
                    pass
    finally:
        os.close(pidfd)
    return len(found["listen"])


def unreachable(pid: int, port: int | None = None) -> None:
    """``pid``'s server on ``port`` — on every port it listens on, by default, as a firewall
    dropping inbound traffic would (a daemon's HTTP and bulk ports) — stops answering; the
    process runs on."""
    ports = [port] if port is not None else _listening(pid)
    if not ports or not all(_set_filter(pid, p, keep=False) for p in ports):
        raise RuntimeError(f"process {pid} has no listening socket on port {port if port is not None else 'any'}")


def heal(pid: int, port: int | None = None) -> None:
    """Undo ``unreachable``."""
    for p in [port] if port is not None else _listening(pid):
        _set_filter(pid, p, keep=True)


def _listening(pid: int) -> list[int]:
    """The TCP ports ``pid`` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if path.exists():
            for line in path.read_text().splitlines()[1:]:
                f = line.split()
                if f[3] == "0A" and f[9] in inodes:
                    ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def flip(path: Path, at: int, n: int = 16) -> None:
    """Overwrite ``n`` bytes of ``path`` at ``at`` with 0xff (a bit flip the checksum must catch)."""
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(b"\xff" * n)


def damage_tree(index_dir: Path, key: str, rng: random.Random) -> bool:
    """Change one digit of the tree in the index record ``key`` (a committed version's header),
    keeping its length, so LMDB stays valid and only the header's digest can tell. False if there
    is no such record or no digit in its tree."""
    import lmdb

    env = lmdb.open(str(index_dir), max_dbs=0)
    try:
        with env.begin(write=True) as txn:
            raw = txn.get(key.encode())
            if raw is None:
                return False
            record = json.loads(raw)
            tree = record["header"].get("tree_json", "")
            digits = [i for i, ch in enumerate(tree) if ch.isdigit()]
            if not digits:
                return False
            at = rng.choice(digits)
            changed = tree[:at] + str((int(tree[at]) + 1 + rng.randrange(9)) % 10) + tree[at + 1 :]
            record["header"]["tree_json"] = changed
            txn.put(key.encode(), json.dumps(record).encode())
            return True
    finally:
        env.close()


def bulk_abuse(host: str, port: int, token: str, rng: random.Random, per_kind: int = 40) -> list[socket.socket]:
    """Connections a stranger and a stalled peer make to a daemon's bulk port: idle ones, heads
    announcing 64 MiB of metadata, half-sent HELLOs, random bytes, and two senders with the token
    that stop mid-push. Returned open: close them to end it."""
    from statestore.transport.bulk_wire import META_LIMIT, BulkHead, BulkMeta, Op

    opened: list[socket.socket] = []

    def conn() -> socket.socket:
        s = socket.create_connection((host, port), timeout=5)
        opened.append(s)
        return s

    try:
        for _ in range(per_kind):
            conn()  # idle
            conn().sendall(BulkHead(Op.PUSH, 1, 0, 0).pack()[:8] + META_LIMIT.to_bytes(4, "little") + bytes(16))
            conn().sendall(BulkHead(Op.HELLO, 1000, 0, 0).pack() + b"abc")
            conn().sendall(rng.randbytes(rng.randrange(1, 4096)))
        for i in range(2):
            s = conn()
            s.sendall(BulkHead.hello(token))
            meta = BulkMeta("abuse", f"dp{i}-pp0-tp0", 1, 1 << 20, "0123abcd", {"tree_json": "1"}, "stranger").pack()
            s.sendall(BulkHead(Op.PUSH, len(meta), 0, 1 << 20).pack() + meta + rng.randbytes(4096))
    except OSError:
        pass  # refused or reset midway: what was opened is the abuse
    return opened


def close_all(opened: list[socket.socket]) -> None:
    for s in opened:
        s.close()


def kill_newest_worker(newest: Callable[[], int], tries: int = 20) -> None:
    """SIGKILL the worker ``newest()`` names, asking again (every 0.1 s) while the one it names
    is already gone; nothing if none is found alive."""
    for _ in range(tries):
        try:
            os.kill(newest(), signal.SIGKILL)
            return
        except (ProcessLookupError, StopIteration):
            time.sleep(0.1)
