"""The cache's room in the daemon's budget: what each fetch under way holds (``Reservation``),
how a fetch grows it before any byte is written, how a step a reader waits on makes room
(evicting what no reader is on, then stopping prefetches), the link gate a fetch passes, and the
eviction of what the readers' window left behind."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

from ffplane_contract.errors import CapacityError, UnavailableError
from statestore import shm
from statestore._cache_streams import CachedFile, Stream, file_key
from statestore.budget import CACHE_HOLDER, Budget
from statestore.config import DaemonConfig
from statestore.index import Index
from statestore.link_gate import LinkGate, Priority

_ROOM_POLL_S = 0.5  # a step a reader waits on for room looks again this often (and whenever a fetch's room frees)


class PutOff(UnavailableError):
    """A prefetch that waits for room: a reader asking for it retries, as for a busy data server."""


@dataclass(eq=False)
class Reservation:
    """The room one fetch holds in the budget for bytes not cached yet: the size the data server
    announced, or what has arrived of a body that came without one (grown chunk by chunk, before
    each chunk is written); handed over to the file when it is published, or freed when the
    fetch ends otherwise. A prefetch's room is taken back (``preempted``) for a step a reader
    waits on: the prefetch stops at its next chunk."""

    stream: Stream
    step: int
    size: int | None = None  # the body's announced size, if it had one
    nbytes: int = 0
    preempted: bool = False


def needed(stream: Stream, step: int) -> bool:
    """A reader waits on ``step`` (or has passed it): not a prefetch."""
    return bool(stream.readers) and step <= max(stream.readers.values())


class Admission:
    """The cache's share of ``budget`` over ``streams`` (the cache's own dict, shared)."""

    def __init__(
        self, config: DaemonConfig, budget: Budget, index: Index, gate: LinkGate | None, streams: dict[tuple[str, int], Stream]
    ) -> None:
        self.config = config
        self.budget = budget
        self.index = index
        self.gate = gate  # fetches wait at it (none: they never wait)
        self.streams = streams
        self._reservations: set[Reservation] = set()  # the room of the fetches under way
        self._room_freed = asyncio.Event()  # set when a reservation ends: a step a reader waits on may fit now
        self.peak_bytes = 0  # the most the cache ever held (or had reserved) at once: at most the budget

    def cached_bytes(self) -> int:
        """Bytes the cache holds: its files, and the room of the fetches under way."""
        return sum(s.nbytes() for s in self.streams.values()) + sum(r.nbytes for r in self._reservations)

    def note_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.cached_bytes())

    # --- the room of one fetch -----------------------------------------------------------
    @contextmanager
    def reservation(self, stream: Stream, step: int) -> Iterator[Reservation]:
        """Room for one fetch of ``step``, none yet (``hold`` grows it), freed when the block
        ends unless ``release`` handed it to the file first."""
        res = Reservation(stream, step)
        self._reservations.add(res)
        try:
            yield res
        finally:
            self.release(res)

    def release(self, res: Reservation) -> None:
        if res in self._reservations:
            self._reservations.discard(res)
            self._room_freed.set()

    async def hold(self, res: Reservation, total: int) -> None:
        """Grow ``res`` to ``total`` bytes within the budget, before they are written.

        A prefetch that does not fit is put off (503) until room frees; so is one whose room a
        waited-on step took back. A step a reader waits on makes room by evicting what no reader is
        on (consumed steps kept for replay first, then the furthest prefetched), then by stopping
        the prefetches under way; one that cannot fit even so is a ``CapacityError``."""
        stream, step = res.stream, res.step
        if res.preempted and not needed(stream, step):
            raise PutOff(f"prefetch of {stream.key} step {step} put off: a step a reader waits on took its room")
        while (need := total - res.nbytes) > 0:
            if self.budget.free() >= need:
                res.nbytes = total
                self.peak_bytes = max(self.peak_bytes, self.cached_bytes())
                return
            if not needed(stream, step):
                raise PutOff(f"prefetch of {stream.key} step {step} put off: the cache is at its budget")
            self.evict_victims(lambda: self.budget.free() >= need)
            if self.budget.free() >= need:
                continue
            prefetches = [r for r in self._reservations if not needed(r.stream, r.step)]
            stuck = self.cached_bytes() - sum(r.nbytes for r in prefetches) - res.nbytes  # what no one can free now
            if stuck + self.budget.others(CACHE_HOLDER) + total > self.budget.total:
                raise self._too_big(res, total, stuck)
            for r in prefetches:  # they stop at their next chunk; their room frees as they do
                r.preempted = True
            if self.gate is not None:
                self.gate.recheck()  # (one held at the gate is let through, to stop)
            self._room_freed.clear()
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._room_freed.wait(), _ROOM_POLL_S)

    def _too_big(self, res: Reservation, total: int, stuck: int) -> CapacityError:
        mib = 1 << 20
        size = f"{res.size / mib:.1f} MiB" if res.size is not None else f"over {total / mib:.1f} MiB"
        return CapacityError(
            f"step {res.step} of {res.stream.key} ({size}) does not fit in the daemon's budget of "
            f"{self.budget.total / mib:.1f} MiB ({stuck / mib:.1f} MiB of cached steps readers are on, "
            f"{self.budget.others(CACHE_HOLDER) / mib:.1f} MiB of state slots and replicas); raise --budget-mb (and the tmpfs), or lower --window",
        )

    async def admit(self, res: Reservation, nbytes: int) -> None:
        """Pass the link gate with ``nbytes`` of ``res``'s body (there is one)."""
        assert self.gate is not None
        stream, step = res.stream, res.step

        def next_batch() -> bool:  # asked again while it waits: a prefetch becomes the next batch
            return bool(stream.readers) and step <= max(stream.readers.values()) + 1

        def urgent() -> bool:  # (a prefetch whose room was taken back goes through, to stop)
            return next_batch() or res.preempted

        await self.gate.acquire(Priority.NEXT_BATCH if next_batch() else Priority.PREFETCH, nbytes, critical=urgent)
        await self.hold(res, res.nbytes)  # stop here if its room was taken back while it waited

    # --- eviction ------------------------------------------------------------------------
    def evict(self, stream: Stream) -> None:
        """Drop ``stream``'s files the readers' window left behind."""
        win = stream.window(self.config.window)
        if win is None:
            return
        floor = win[0] - self.config.keep_consumed
        # past the window by more than a prefetch reaches (a run starts within fetch_steps - 1 of it):
        # left by a reader that jumped back (a restore), never read in this pass
        reach = max(self.config.window, self.config.fetch_steps - 1)
        old = [f for f in stream.files.values() if f.end <= floor or f.first >= win[1] + reach]
        for cached in old:
            stream.drop(cached)
            shm.unlink(cached.path)  # readers holding a mapping keep their pages
        if old:
            self.index.delete(*(file_key(stream, f) for f in old))

    def evict_victims(self, enough: Callable[[], bool]) -> None:
        """Unlink files no reader is on, in ``_victims``' order, until ``enough()``."""
        for victim, cached in self._victims():
            if enough():
                break
            victim.drop(cached)
            shm.unlink(cached.path)  # a reader still mapping it keeps its pages
            self.index.delete(file_key(victim, cached))

    def _victims(self) -> list[tuple[Stream, CachedFile]]:
        """Files no reader is on: consumed ones, oldest first, then the furthest prefetched."""
        consumed: list[tuple[int, Stream, CachedFile]] = []
        ahead: list[tuple[int, Stream, CachedFile]] = []
        for st in self.streams.values():
            at = st.readers.values()
            for f in st.files.values():
                if any(f.first <= s < f.end for s in at):
                    continue
                if not at or f.end <= min(at):
                    consumed.append((f.first, st, f))
                elif f.first > max(at):
                    ahead.append((-f.first, st, f))
        consumed.sort(key=lambda c: c[0])
        ahead.sort(key=lambda a: a[0])
        return [(st, f) for _, st, f in consumed + ahead]
