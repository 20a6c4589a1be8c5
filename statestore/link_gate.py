"""The link gate: one per node, deciding whether STATE traffic may use the network right now.

Everything the daemon moves over the network — batch prefetch, replica pushes, shard pulls for a
remote restore — goes through :meth:`LinkGate.acquire` one chunk at a time, so a TRAIN burst is
delayed by at most the chunk already in flight. Three signals, in order of trust:

1. *hints*: every training process on the node keeps a busy counter in a small shared-memory file
   ``<root>/hints/<pid>`` (``trainer_client.LinkHints``: a context manager and a DDP comm hook);
   any counter above zero closes the gate;
2. *interface counters*: the training NIC's rx+tx byte counters minus the bytes this gate let
   through; foreign traffic above ``busy_fraction`` of the link rate closes the gate for
   ``hold_s`` (a collective the hints did not announce);
3. a *rate cap*: a token bucket over all STATE bytes.

When the gate is contended, waiters go in the priority order of DESIGN.md: the batch a local
worker needs next, replication of the newest committed version, prefetch further ahead, the
durable tier. The first passes even while TRAIN runs (only the rate cap holds it): a worker
blocked on it is part of the collective TRAIN is waiting for.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

from ffplane_contract.files import HINT, HINTS_DIR
from statestore.procs import alive

log = logging.getLogger(__name__)
_RECHECK_S = 0.005  # a closed gate's waiters look again at least this often
# uvloop (the daemon's loop, through uvicorn) counts timers in whole milliseconds and rounds:
# asyncio.sleep(0.0005) there is no sleep at all, and the watcher spun a core at ~500,000 looks/s
# whenever a transfer waited behind TRAIN (docs/decisions.md, "The gate's watcher spun a core").
_TIMER_RESOLUTION_S = 0.001


class Priority(IntEnum):
    NEXT_BATCH = 1
    REPLICATE = 2
    PREFETCH = 3
    DURABLE = 4


@dataclass
class GateConfig:
    rate_cap_bytes_s: float = 0.0  # 0: no cap
    iface: str = ""  # training interface whose counters reveal unannounced TRAIN traffic; "" = off
    link_bytes_s: float = 0.0  # that interface's rate; needed with ``iface``
    busy_fraction: float = 0.05  # foreign traffic above this share of the link rate means busy
    hold_s: float = 0.005  # how long foreign traffic keeps the gate closed
    poll_s: float = 0.001  # how often a closed gate looks again (no shorter: _TIMER_RESOLUTION_S)
    chunk_bytes: int = 64 << 10  # STATE moves in chunks this size (a TRAIN burst waits for ~one; bench/link_gate.py)
    enabled: bool = True  # off: only the counters run (the ungated baseline of bench/link_gate.py)

    def validate(self) -> None:
        if self.rate_cap_bytes_s < 0:
            raise ValueError(f"rate cap must be >= 0, got {self.rate_cap_bytes_s}")
        if self.iface and self.link_bytes_s <= 0:
            raise ValueError("watching an interface needs its link rate (--gate-link-mbit)")
        if self.poll_s < _TIMER_RESOLUTION_S:
            raise ValueError(
                f"gate poll must be >= {_TIMER_RESOLUTION_S * 1e3:g} ms (the event loop's timer resolution), got {self.poll_s * 1e3:g} ms"
            )
        if self.chunk_bytes < 4096:
            raise ValueError(f"gate chunk must be >= 4 KiB, got {self.chunk_bytes}")


class _Hints:
    """The busy counters of the node's training processes, mapped read-only."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        self._maps: dict[str, mmap.mmap] = {}
        self._scanned = 0.0

    def busy(self) -> bool:
        now = time.monotonic()
        if now - self._scanned > 0.1:  # new workers appear, dead ones are dropped
            self._scanned = now
            self._rescan()
        return any(HINT.unpack_from(mm)[0] > 0 for mm in self._maps.values())

    def _rescan(self) -> None:
        names = set(os.listdir(self.directory))
        for gone in set(self._maps) - names:
            self._maps.pop(gone).close()
        for name in names - set(self._maps):
            path = self.directory / name
            if not _pid_alive(name):
                path.unlink(missing_ok=True)
                continue
            try:
                fd = os.open(path, os.O_RDONLY)
                try:
                    if os.fstat(fd).st_size >= HINT.size:
                        self._maps[name] = mmap.mmap(fd, HINT.size, prot=mmap.PROT_READ)
                finally:
                    os.close(fd)
            except OSError:
                continue
        for name in [n for n in self._maps if not _pid_alive(n)]:  # a killed worker's counter may be stuck above 0
            self._maps.pop(name).close()
            (self.directory / name).unlink(missing_ok=True)

    def close(self) -> None:
        for mm in self._maps.values():
            mm.close()
        self._maps.clear()


def _pid_alive(name: str) -> bool:
    return name.isdigit() and alive(int(name))


class _Interface:
    """Foreign bytes on the training NIC: its counters minus what the gate itself let through."""

    def __init__(self, config: GateConfig) -> None:
        base = Path("/sys/class/net") / config.iface / "statistics"
        self._files = [base / "rx_bytes", base / "tx_bytes"]
        if not all(f.exists() for f in self._files):
            raise ValueError(f"no interface {config.iface!r} here (looked for {base}); name the training NIC with --gate-iface")
        self.config = config
        self._last_total = self._read()
        self._last_own = 0
        self._last_at = time.monotonic()
        self._busy_until = 0.0

    def _read(self) -> int:
        return sum(int(f.read_text()) for f in self._files)

    def busy(self, own_bytes: int) -> bool:
        now = time.monotonic()
        if now - self._last_at >= 0.002:
            total = self._read()
            # framing and ACKs add a few percent to what the gate counts as its own
            foreign = (total - self._last_total) - 1.08 * (own_bytes - self._last_own)
            rate = foreign / (now - self._last_at)
            if rate > self.config.busy_fraction * self.config.link_bytes_s:
                self._busy_until = now + self.config.hold_s
            self._last_total, self._last_own, self._last_at = total, own_bytes, now
        return now < self._busy_until


class LinkGate:
    def __init__(self, config: GateConfig, root: Path) -> None:
        config.validate()
        self.config = config
        self.hints = _Hints(root / HINTS_DIR)
        self.interface = _Interface(config) if config.iface else None
        self.enabled = config.enabled
        self._waiting = {p: 0 for p in Priority}
        self._next_free = 0.0  # token bucket: when the cap allows the next byte
        self._wakeup: asyncio.Future[None] | None = None  # resolved when waiters should look again
        self._watcher: asyncio.Future[None] | None = None
        self.bytes_by_priority = {p: 0 for p in Priority}
        self.own_bytes = 0
        self.paused_s = 0.0  # waiting for TRAIN (hints, interface) or a higher priority
        self.throttled_s = 0.0  # waiting for the rate cap
        self.pauses = 0
        self.looks = 0  # the watcher's looks at TRAIN's signals while someone waits
        self.last_reason = ""

    def closed_because(self, priority: Priority = Priority.REPLICATE, critical: bool = False) -> str:
        """Why the gate is closed now for ``priority`` ("" when open).

        The batch a local worker is blocked on passes regardless of TRAIN: that worker holds up
        its collective, so the training network would wait on the gate, which waits on the
        training network (a deadlock, seen in the node-loss test before this rule)."""
        if not self.enabled or critical or priority == Priority.NEXT_BATCH:
            return ""
        if self.hints.busy():
            return "hint"
        if self.interface is not None and self.interface.busy(self.own_bytes):
            return "interface"
        return ""

    async def acquire(self, priority: Priority, nbytes: int, critical: bool | Callable[[], bool] = False) -> None:
        """Wait until ``nbytes`` of STATE may move at ``priority``; counts them as sent.
        ``critical``: training is, or is about to be, held up by this transfer, so TRAIN's signals
        do not hold it (the batch a worker waits for always is; a replica a commit waits for, too).
        A callable is asked again while waiting: a transfer can become critical at the gate."""
        started = time.monotonic()
        self._waiting[priority] += 1
        paused = False
        try:
            while True:
                urgent = critical() if callable(critical) else critical
                reason = self.closed_because(priority, urgent)
                # an urgent transfer does not queue behind higher priorities either: they may be
                # waiting for TRAIN, and TRAIN for this transfer
                if not reason and not urgent and any(self._waiting[p] for p in Priority if p < priority):
                    reason = "priority"
                if not reason:
                    break
                if not paused:
                    paused, self.last_reason = True, reason
                    self.pauses += 1
                await self._look_again()
            if self.config.rate_cap_bytes_s > 0:
                now = time.monotonic()
                start = max(now, self._next_free)
                self._next_free = start + nbytes / self.config.rate_cap_bytes_s
                if start > now:
                    self.throttled_s += start - now
                    await asyncio.sleep(start - now)
        finally:
            self._waiting[priority] -= 1
            if any(self._waiting.values()):
                self._wake()  # lower priorities may go now
        if paused:
            self.paused_s += time.monotonic() - started
        self.bytes_by_priority[priority] += nbytes
        self.own_bytes += nbytes

    async def _look_again(self) -> None:
        """Wait until a closed gate is worth asking again. One watcher task polls TRAIN's signals
        for all waiters, instead of each waiter waking every ``poll_s`` on its own (with four
        prefetches and a few pushes held, thousands of wake-ups a second)."""
        if self._wakeup is None or self._wakeup.done():
            self._wakeup = asyncio.get_running_loop().create_future()
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.ensure_future(self._watch())
        await asyncio.shield(self._wakeup)

    def recheck(self) -> None:
        """Something a waiter's ``critical`` depends on changed: let every waiter look again now."""
        self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def _watch(self) -> None:
        """While anyone waits: wake the waiters when TRAIN's signals clear, and every
        ``_RECHECK_S`` regardless (a transfer can turn critical while it waits)."""
        last = time.monotonic()
        while any(self._waiting.values()):
            await asyncio.sleep(self.config.poll_s)
            self.looks += 1
            now = time.monotonic()
            if not self.closed_because(Priority.REPLICATE) or now - last >= _RECHECK_S:
                last = now
                self._wake()

    def describe(self) -> dict[str, Any]:
        reason = self.closed_because()
        return {
            "enabled": self.enabled,
            "open": not reason,
            "closed_because": reason or None,
            "last_pause_reason": self.last_reason or None,
            "bytes_sent": self.own_bytes,
            "bytes_by_priority": {p.name.lower(): n for p, n in self.bytes_by_priority.items()},
            "paused_s": round(self.paused_s, 6),
            "throttled_s": round(self.throttled_s, 6),
            "pauses": self.pauses,
            "looks": self.looks,
            "waiting": {p.name.lower(): n for p, n in self._waiting.items() if n},
            "config": {
                "rate_cap_bytes_s": self.config.rate_cap_bytes_s,
                "iface": self.config.iface or None,
                "link_bytes_s": self.config.link_bytes_s,
                "chunk_bytes": self.config.chunk_bytes,
            },
        }

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        self.hints.close()
