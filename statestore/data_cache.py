"""The node data cache: batches of the next W steps of every local dp rank, in shared memory.

One *stream* per ``(job, dp_rank)`` whatever the number of local readers (tp/pp ranks of one dp
rank share data, so they share one copy). Each step is one file — an Arrow IPC stream of one
record batch — written under a temporary name and published by rename, so readers map it
zero-copy and never see it change. A stream prefetches steps ``[slowest reader, fastest reader +
W)`` in step order (the step a reader waits on is always the lowest missing one, so order is
priority), keeps ``keep_consumed`` steps behind the slowest reader for replay, and unlinks the rest.

A step is fetched alone, its file exactly the body the data server sent — unless steps are small
(tokens: a few KiB, where a request costs the data server ~1 ms of CPU and the step's bytes
nothing): then a prefetch asks for ``fetch_steps`` consecutive steps in one request, up to
``fetch_steps - 1`` past the window, and the body, checked to hold exactly those steps, is one file
named for its first step (``check_run``). A reader maps such a file once and reads each of its steps
from that mapping, telling the daemon where it is only on entering a file, when the next run is
fetched (runs start while a missing step is within ``fetch_steps - 1`` past the window): per small
step no file is created, renamed, indexed, unlinked or mapped and no request is sent. A run that
fails is fetched again step by step, so its errors are exactly those of single fetches.

The cache, not its readers, keeps its steps to the job's current plan (``job_plans``): each file
keeps the generation its steps were planned in, and each reader's ``open`` asks the data server for
the job's generations first. A step planned before an elastic change is dropped before a reader
can map it, and fetched again; a fetched step planned before the job's plan as last seen makes the
cache ask again, and is refused if it is still behind it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pyarrow as pa

from ffplane_contract.auth import bearer
from ffplane_contract.errors import (
    CapacityError,
    CorruptError,
    FFPlaneError,
    FFTimeoutError,
    TransportError,
    UnavailableError,
    error_from,
)
from ffplane_contract.files import step_file
from statestore import shm
from statestore.budget import CACHE_HOLDER, Budget
from statestore.config import DaemonConfig
from statestore.dataservers import DataServers
from statestore.index import Index
from statestore.job_plans import CURRENT, STALE, JobPlan, file_generations, generations_of
from statestore.link_gate import LinkGate, Priority

log = logging.getLogger(__name__)
_T = TypeVar("_T")


_CONNECT_S = 2.0  # a data server that takes no connection this long is passed over (sends nothing: --fetch-read-timeout-s)
RUN_STEP_BYTES = 256 << 10  # steps at most this big are prefetched ``fetch_steps`` per request
_ROOM_POLL_S = 0.5  # a step a reader waits on for room looks again this often (and whenever a fetch's room frees)
_PLAN_AGAIN_S = 1.0  # a fetched step off the job's plan asks the data server for the plan at most this often a stream


class _PutOff(UnavailableError):
    """A prefetch that waits for room: a reader asking for it retries, as for a busy data server."""


class _RunTooLarge(FFPlaneError):
    """A run's body is past what runs are for (steps grew since the estimate): its steps are
    fetched one by one, each within the budget like any large step. Not the server's fault."""

    status = 413


class _Replanned(CorruptError):
    """A fetched step planned before the generation the job now plans it in (the data server
    answered before an elastic change): not published; a reader waiting on it fetches it again."""


@dataclass(eq=False)
class CachedFile:
    """One published file of the stream: ``count`` consecutive steps from ``first``."""

    path: Path
    nbytes: int
    first: int
    count: int = 1
    generations: tuple[int, ...] | None = None  # the generation each step was planned in (None: untagged)

    @property
    def end(self) -> int:
        return self.first + self.count


@dataclass(eq=False)
class _Reservation:
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


@dataclass
class Stream:
    job: str
    dp_rank: int
    directory: Path
    token: str | None = None
    readers: dict[int, int] = field(default_factory=dict)  # reader id → next step it needs
    files: dict[int, CachedFile] = field(default_factory=dict)  # first step → file
    ready: dict[int, CachedFile] = field(default_factory=dict)  # every cached step → the file holding it
    inflight: dict[int, asyncio.Future[CachedFile]] = field(default_factory=dict)
    failed: dict[int, FFPlaneError] = field(default_factory=dict)
    end_step: int | None = None  # first step the data server refused as out of range (prefetches stop there)
    step_bytes: int = 0  # the size of the last step the data server announced
    plan: JobPlan | None = None  # the job's generations as a data server last said (None: not known)
    plan_at: float = 0.0  # when it was last asked (monotonic)
    plan_task: asyncio.Task[None] | None = None  # the request for it under way
    hits: int = 0
    misses: int = 0
    wait_s: float = 0.0
    fetched: int = 0
    requests: int = 0  # fetch requests sent to data servers (fewer than ``fetched`` where runs are on)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    pump: asyncio.Task[None] | None = None

    @property
    def key(self) -> str:
        return f"{self.job}/{self.dp_rank}"

    def window(self, ahead: int) -> tuple[int, int] | None:
        if not self.readers:
            return None
        return min(self.readers.values()), max(self.readers.values()) + ahead

    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files.values())

    def add(self, cached: CachedFile) -> None:
        self.files[cached.first] = cached
        for step in range(cached.first, cached.end):
            self.ready[step] = cached

    def drop(self, cached: CachedFile) -> None:
        """Forget ``cached`` (the caller unlinks it and deletes its index record)."""
        del self.files[cached.first]
        for step in range(cached.first, cached.end):
            del self.ready[step]

    def describe(self, ahead: int) -> dict[str, Any]:
        win = self.window(ahead)
        lag = 0 if win is None else sum(1 for s in range(*win) if s not in self.ready)
        return {
            "job": self.job,
            "dp_rank": self.dp_rank,
            "readers": len(self.readers),
            "reader_steps": sorted(self.readers.values()),
            "steps": sorted(self.ready),
            "files": len(self.files),
            "fetching": sorted(self.inflight),
            "bytes": self.nbytes(),
            "hits": self.hits,
            "misses": self.misses,
            "fetched": self.fetched,
            "requests": self.requests,
            "end_step": self.end_step,
            "prefetch_lag_steps": lag,
            "reader_wait_s": round(self.wait_s, 6),
        }


async def _copy_body(resp: aiohttp.ClientResponse, fd: int, before_write: Callable[[int], Awaitable[None]]) -> int:
    """Write the body to ``fd`` as it arrives; returns its size. ``before_write`` is awaited with
    each chunk's size before the chunk is written (room in the budget, the link gate).

    Chunks are taken as aiohttp buffered them (``iter_chunks`` pops them; ``iter_any`` would
    join them, a copy) and written whole huge pages at a time (``shm.PageWriter``), on the
    event loop: a worker thread overlapped the writes with the next receive, but its GIL
    hand-offs cost more than the overlap saved on 2 cores (64 futex calls and ~1 ms of system
    time per 4 MiB step).
    """
    out = shm.PageWriter(fd)
    async for chunk, _ in resp.content.iter_chunks():
        await before_write(len(chunk))
        out.add(chunk)
    out.flush()
    return out.offset


def _index_key(job: str, dp_rank: int, step: int) -> str:
    return f"data/{job}/{dp_rank}/{step:012d}"


def _file_key(stream: Stream, cached: CachedFile) -> str:
    return _index_key(stream.job, stream.dp_rank, cached.first)


class DataCache:
    def __init__(
        self, config: DaemonConfig, index: Index, token: str | None, gate: LinkGate | None, servers: DataServers, budget: Budget
    ) -> None:
        """``budget``: the daemon's one ledger, shared with the slots and replicas; the cache
        counts in it as ``cache``."""
        self.config = config
        self.budget = budget
        self.servers = servers
        self.index = index
        self.token = token
        self.streams: dict[tuple[str, int], Stream] = {}
        self._fetch_slots = asyncio.Semaphore(config.fetch_concurrency)
        self._session: aiohttp.ClientSession | None = None
        self.bytes_fetched = 0
        self._reservations: set[_Reservation] = set()  # the room of the fetches under way
        self._room_freed = asyncio.Event()  # set when a reservation ends: a step a reader waits on may fit now
        self.peak_bytes = 0  # the most the cache ever held (or had reserved) at once: at most the budget
        self.gate = gate  # fetches wait at it (none: they never wait)
        budget.register(CACHE_HOLDER, self.cached_bytes)

    # --- lifecycle -----------------------------------------------------------------------
    def reattach(self) -> tuple[int, int]:
        """Adopt every indexed step whose file is intact; drop the rest. Returns (kept, dropped)."""
        kept = dropped = 0
        known: set[Path] = set()
        for key, entry in self.index.items("data/"):
            _, job, rank, step = key.split("/")
            path = self.config.root / entry["file"]
            if path.is_file() and path.stat().st_size == entry["nbytes"]:
                stream = self._stream(job, int(rank))
                count = int(entry.get("steps", 1))
                gens = entry["generations"] if "generations" in entry else file_generations(path, count)  # (indexed before tags)
                stream.add(CachedFile(path, entry["nbytes"], int(step), count, None if gens is None else tuple(gens)))
                known.add(path)
                kept += 1
            else:
                self.index.delete(key)
                dropped += 1
        for path in self.config.root.glob("*/data/*/*.arrow"):
            if path not in known:  # published but never indexed: the daemon died in between
                shm.unlink(path)
                dropped += 1
        self.peak_bytes = max(self.peak_bytes, self.cached_bytes())
        return kept, dropped

    def shrink(self, to_bytes: int) -> int:
        """Drop cached files no reader is on until the cache holds at most ``to_bytes``; the
        bytes dropped."""
        before = self.cached_bytes()
        self._evict_victims(lambda: self.cached_bytes() <= to_bytes)
        return before - self.cached_bytes()

    def cached_bytes(self) -> int:
        """Bytes the cache holds: its files, and the room of the fetches under way."""
        return sum(s.nbytes() for s in self.streams.values()) + sum(r.nbytes for r in self._reservations)

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            # a server that died without a reset (its host lost) is passed over after these
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=_CONNECT_S, sock_read=self.config.fetch_read_timeout_s),
            connector=aiohttp.TCPConnector(limit=self.config.fetch_concurrency * 2),
        )

    async def close(self) -> None:
        for stream in self.streams.values():
            if stream.pump is not None:
                stream.pump.cancel()
        for stream in self.streams.values():
            for fut in stream.inflight.values():
                fut.cancel()
        if self._session is not None:
            await self._session.close()

    # --- reader protocol -----------------------------------------------------------------
    def _stream(self, job: str, dp_rank: int) -> Stream:
        stream = self.streams.get((job, dp_rank))
        if stream is None:
            directory = shm.private_dir(self.config.root / job / "data" / str(dp_rank))
            stream = Stream(job, dp_rank, directory)
            self.streams[(job, dp_rank)] = stream
        return stream

    def attach(self, reader: int, job: str, dp_rank: int, token: str | None) -> Stream:
        stream = self._stream(job, dp_rank)
        if token:
            stream.token = token
        if stream.pump is None or stream.pump.done():
            stream.pump = asyncio.create_task(self._pump(stream), name=f"pump {stream.key}")
        return stream

    def detach(self, reader: int, stream: Stream) -> None:
        stream.readers.pop(reader, None)

    async def get(self, reader: int, stream: Stream, step: int) -> tuple[CachedFile, bool]:
        """The cached file holding ``step``, waiting for it if needed; also moves the reader's cursor."""
        stream.readers[reader] = step
        # Eviction (unlinks, an index transaction) runs after the reply is sent, not before it.
        asyncio.get_running_loop().call_soon(self._evict, stream)
        stream.wake.set()
        cached = stream.ready.get(step)
        if cached is not None and stream.plan is not None and stream.plan.compare(cached.first, cached.generations) == STALE:
            self._drop_stale(stream)  # (dropped when the plan changed; this one published since)
            cached = None
        if cached is not None:
            stream.hits += 1
            return cached, True
        stream.misses += 1
        if self.gate is not None and step in stream.inflight:
            self.gate.recheck()  # its fetch may be held at the gate as a prefetch: now it is needed
        started = time.perf_counter()
        try:
            while True:
                stream.failed.pop(step, None)  # a reader asking again is a retry
                fut = stream.inflight.get(step) or self._start_fetch(stream, step)
                try:
                    return await asyncio.shield(fut), False
                except FFPlaneError as exc:
                    stream.failed.pop(step, None)
                    # A data server restarting or briefly unreachable is not the reader's problem,
                    # nor one answering from before a new generation; a step that cannot fit the
                    # budget will not fit in a moment either.
                    retried = (TransportError, FFTimeoutError, _Replanned)
                    if not isinstance(exc, retried) or time.perf_counter() - started > self.config.fetch_retry_s:
                        raise
                    await asyncio.sleep(0.2)
        finally:
            stream.wait_s += time.perf_counter() - started

    # --- prefetching ---------------------------------------------------------------------
    async def _pump(self, stream: Stream) -> None:
        while True:
            await stream.wake.wait()
            stream.wake.clear()
            win = stream.window(self.config.window)
            if win is None:
                continue
            estimate = self._step_estimate(stream)
            runs = self.config.fetch_steps > 1 and 0 < estimate <= RUN_STEP_BYTES
            in_flight = self.config.fetch_concurrency * (self.config.fetch_steps if runs else 1)  # steps, not requests
            # A reader of runs says where it is only on entering a file: the next run is fetched
            # then, a run ahead, not when the window reaches it
            horizon = win[1] + self.config.fetch_steps - 1 if runs else win[1]
            planned = 0  # fetches started in this pass reserve their room only when answered
            for step in range(win[0], horizon if stream.end_step is None else min(horizon, stream.end_step)):
                if not self._missing(stream, step):
                    continue
                if len(stream.inflight) >= in_flight:
                    break
                if estimate == 0 and (stream.inflight or planned):  # no step's size known yet: one first
                    break
                fit = (self.budget.free() - planned) // max(estimate, 1)
                if fit < 1:
                    if not planned:  # (otherwise the room is what this pass has just asked for)
                        log.warning(
                            "cache budget reached; prefetch paused", extra={"job": stream.job, "dp_rank": stream.dp_rank, "step": step}
                        )
                    break
                run = self._run(stream, step)[:fit] if runs else [step]
                planned += len(run) * estimate
                if len(run) == 1:
                    self._start_fetch(stream, step)
                else:
                    self._start_run(stream, run)

    def _missing(self, stream: Stream, step: int) -> bool:
        return step not in stream.ready and step not in stream.inflight and step not in stream.failed

    def _run(self, stream: Stream, step: int) -> list[int]:
        """The consecutive missing steps from ``step`` one request fetches: up to ``fetch_steps``
        (the pump starts one while a missing step is within ``fetch_steps - 1`` past the window,
        so in a steady run each request brings ``fetch_steps`` new steps, a run ahead)."""
        end = step + self.config.fetch_steps
        if stream.end_step is not None:
            end = min(end, stream.end_step)
        run = [step]
        while run[-1] + 1 < end and self._missing(stream, run[-1] + 1):
            run.append(run[-1] + 1)
        return run

    def _step_estimate(self, stream: Stream) -> int:
        return max(max((f.nbytes // f.count for f in stream.files.values()), default=0), stream.step_bytes)

    @staticmethod
    def _needed(stream: Stream, step: int) -> bool:
        """A reader waits on ``step`` (or has passed it): not a prefetch."""
        return bool(stream.readers) and step <= max(stream.readers.values())

    @contextmanager
    def _reservation(self, stream: Stream, step: int) -> Iterator[_Reservation]:
        """Room for one fetch of ``step``, none yet (``_hold`` grows it), freed when the block
        ends unless ``_publish`` handed it to the file first."""
        res = _Reservation(stream, step)
        self._reservations.add(res)
        try:
            yield res
        finally:
            self._release(res)

    def _release(self, res: _Reservation) -> None:
        if res in self._reservations:
            self._reservations.discard(res)
            self._room_freed.set()

    async def _hold(self, res: _Reservation, total: int) -> None:
        """Grow ``res`` to ``total`` bytes within the budget, before they are written.

        A prefetch that does not fit is put off (503) until room frees; so is one whose room a
        waited-on step took back. A step a reader waits on makes room by evicting what no reader is
        on (consumed steps kept for replay first, then the furthest prefetched), then by stopping
        the prefetches under way; one that cannot fit even so is a ``CapacityError``."""
        stream, step = res.stream, res.step
        if res.preempted and not self._needed(stream, step):
            raise _PutOff(f"prefetch of {stream.key} step {step} put off: a step a reader waits on took its room")
        while (need := total - res.nbytes) > 0:
            if self.budget.free() >= need:
                res.nbytes = total
                self.peak_bytes = max(self.peak_bytes, self.cached_bytes())
                return
            if not self._needed(stream, step):
                raise _PutOff(f"prefetch of {stream.key} step {step} put off: the cache is at its budget")
            self._evict_victims(lambda: self.budget.free() >= need)
            if self.budget.free() >= need:
                continue
            prefetches = [r for r in self._reservations if not self._needed(r.stream, r.step)]
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

    def _too_big(self, res: _Reservation, total: int, stuck: int) -> CapacityError:
        mib = 1 << 20
        size = f"{res.size / mib:.1f} MiB" if res.size is not None else f"over {total / mib:.1f} MiB"
        return CapacityError(
            f"step {res.step} of {res.stream.key} ({size}) does not fit in the daemon's budget of "
            f"{self.budget.total / mib:.1f} MiB ({stuck / mib:.1f} MiB of cached steps readers are on, "
            f"{self.budget.others(CACHE_HOLDER) / mib:.1f} MiB of state slots and replicas); raise --budget-mb (and the tmpfs), or lower --window",
        )

    def _evict_victims(self, enough: Callable[[], bool]) -> None:
        """Unlink files no reader is on, in ``_victims``' order, until ``enough()``."""
        for victim, cached in self._victims():
            if enough():
                break
            victim.drop(cached)
            shm.unlink(cached.path)  # a reader still mapping it keeps its pages
            self.index.delete(_file_key(victim, cached))

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

    def _start_fetch(self, stream: Stream, step: int) -> asyncio.Future[CachedFile]:
        fut: asyncio.Future[CachedFile] = asyncio.get_running_loop().create_future()
        stream.inflight[step] = fut
        task = asyncio.create_task(self._fetch(stream, step, fut), name=f"fetch {stream.key}/{step}")
        task.add_done_callback(lambda t: None if t.cancelled() else t.exception())
        return fut

    async def _fetch(self, stream: Stream, step: int, fut: asyncio.Future[CachedFile]) -> None:
        final = stream.directory / step_file(step)
        tmp = shm.tmp_path(final)
        try:
            async with self._fetch_slots:
                cached = await self._download(stream, step, tmp, final)
            stream.fetched += 1
            fut.set_result(cached)
        except FFPlaneError as exc:
            if not isinstance(exc, _PutOff):  # a put-off prefetch is tried again once there is room
                stream.failed[step] = exc
            fut.set_exception(exc)
            fut.exception()  # retrieved here; waiters get it from stream.failed / the future
            level = logging.INFO if isinstance(exc, _PutOff) else logging.WARNING
            if exc.status == 416:  # past the job's end: stop prefetching there; said once a stream
                level = logging.INFO if stream.end_step is None else logging.DEBUG
                stream.end_step = step if stream.end_step is None else min(step, stream.end_step)
            log.log(level, "fetch failed", extra={"job": stream.job, "dp_rank": stream.dp_rank, "step": step, "error": str(exc)})
        except BaseException as exc:
            if not fut.done():
                fut.cancel()
            shm.unlink(tmp)
            if not isinstance(exc, asyncio.CancelledError):
                log.exception("fetch crashed", extra={"job": stream.job, "step": step})
            raise
        finally:
            stream.inflight.pop(step, None)
            stream.wake.set()

    def _start_run(self, stream: Stream, steps: list[int]) -> None:
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in steps]
        for step, fut in zip(steps, futs):
            stream.inflight[step] = fut
        task = asyncio.create_task(self._fetch_run(stream, steps, futs), name=f"fetch {stream.key}/{steps[0]}+{len(steps)}")
        task.add_done_callback(lambda t: None if t.cancelled() else t.exception())

    async def _fetch_run(self, stream: Stream, steps: list[int], futs: list[asyncio.Future[CachedFile]]) -> None:
        """Fetch ``steps`` with one request; if that fails in any way, each step on its own (as
        ``_fetch``: its retries, its errors, its end of the job)."""
        got: CachedFile | None = None
        try:
            async with self._fetch_slots:
                got = await self._download_run(stream, steps)
        except _PutOff as exc:  # no room now: the whole run waits, as a single prefetch would
            for step, fut in zip(steps, futs):
                stream.inflight.pop(step, None)
                fut.set_exception(exc)
                fut.exception()  # retrieved: a reader asking for the step fetches it itself
            stream.wake.set()
            log.info("fetch put off", extra={"job": stream.job, "dp_rank": stream.dp_rank, "step": steps[0], "steps": len(steps)})
            return
        except FFPlaneError as exc:
            log.log(
                logging.DEBUG if exc.status == 416 else logging.INFO,  # (past the end: its steps alone find where it is)
                "run fetch failed; fetching its steps one by one",
                extra={"job": stream.job, "dp_rank": stream.dp_rank, "step": steps[0], "steps": len(steps), "error": str(exc)},
            )
        except Exception:  # noqa: BLE001 - a bug here must not cost the readers their steps
            log.exception("run fetch crashed; fetching its steps one by one", extra={"job": stream.job, "step": steps[0]})
        except BaseException:
            for step, fut in zip(steps, futs):
                stream.inflight.pop(step, None)
                if not fut.done():
                    fut.cancel()
            raise
        if got is not None:
            stream.fetched += len(steps)
            for step, fut in zip(steps, futs):
                stream.inflight.pop(step, None)
                fut.set_result(got)
            stream.wake.set()
            return
        for step, fut in zip(steps, futs):
            if stream.end_step is not None and step >= stream.end_step:  # found by a step before it: not asked again
                stream.inflight.pop(step, None)
                fut.set_exception(error_from(416, f"{stream.key} step {step} is past the job's end ({stream.end_step} steps)"))
                fut.exception()
                continue
            await self._fetch(stream, step, fut)
        stream.wake.set()

    async def _download_run(self, stream: Stream, steps: list[int]) -> CachedFile:
        """``_download`` for several steps (servers in ``DataServers.for_run``'s order)."""
        servers = self.servers.for_run(stream.key, steps[0], self.config.fetch_steps)
        return await self._failing_over(servers, lambda server: self._download_run_from(server, stream, steps))

    async def _download_run_from(self, server: str, stream: Stream, steps: list[int]) -> CachedFile:
        assert self._session is not None
        url = f"{server}/v1/jobs/{stream.job}/batches"
        params = {"dp_rank": str(stream.dp_rank), "start": str(steps[0]), "count": str(len(steps))}
        what = f"{stream.key} steps {steps[0]}+{len(steps)}"
        stream.requests += 1
        chunks: list[bytes] = []
        cap = len(steps) * RUN_STEP_BYTES  # what a run is for; bigger steps go one by one, each within the budget
        too_large = _RunTooLarge(f"{what} are over {RUN_STEP_BYTES >> 10} KiB a step now")
        with self._reservation(stream, steps[0]) as res:  # the room of the whole body, held until its file is published
            try:
                async with self._session.get(url, params=params, headers=bearer(stream.token or self.token)) as resp:
                    if resp.status != 200:
                        detail = (await resp.text())[:500]
                        raise error_from(resp.status, f"data server answered {resp.status} for {what}: {detail}")
                    if resp.content_length is not None and resp.content_length > cap:
                        raise too_large
                    res.size = resp.content_length
                    await self._hold(res, resp.content_length if resp.content_length is not None else cap)
                    got = 0
                    async for chunk, _ in resp.content.iter_chunks():
                        got += len(chunk)
                        if got > cap:
                            raise too_large
                        await self._hold(res, got)  # (only looks whether its room was taken back)
                        if self.gate is not None:
                            await self._admit(res, len(chunk))
                        chunks.append(chunk)
            except aiohttp.ClientError as exc:
                raise TransportError(f"cannot fetch {what} from {server}: {exc}") from exc
            body = b"".join(chunks)
            if resp.content_length is not None and len(body) != resp.content_length:
                raise TransportError(f"{what}: body of {len(body)} bytes, Content-Length said {resp.content_length}")
            try:
                gens = check_run(body, steps)
            except (ValueError, pa.ArrowException) as exc:
                raise TransportError(f"{what} from {server}: {exc}") from exc
            await self._check_plan(stream, steps[0], gens)
            final = stream.directory / step_file(steps[0])
            tmp = shm.tmp_path(final)
            try:
                fd = shm.open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                try:
                    shm.presize(fd, len(body))
                    writer = shm.PageWriter(fd)
                    writer.add(memoryview(body))
                    writer.flush()
                finally:
                    os.close(fd)
            except OSError as exc:  # as a single fetch: a full tmpfs is a clear error
                shm.unlink(tmp)
                raise CapacityError(f"cannot cache {what} in {self.config.root}: {exc}; the tmpfs is full") from exc
            stream.step_bytes = len(body) // len(steps)
            return self._publish(res, tmp, final, len(body), len(steps), gens)

    async def _download(self, stream: Stream, step: int, tmp: Path, final: Path) -> CachedFile:
        """Fetch ``step`` from the data server its turn falls to, or at once from the next one
        when that one does not answer or answers 5xx (the same bytes: a batch is a pure function
        of its TID)."""
        servers = self.servers.for_step(stream.key, step)
        return await self._failing_over(servers, lambda server: self._download_from(server, stream, step, tmp, final))

    async def _failing_over(self, servers: list[str], fetch: Callable[[str], Awaitable[_T]]) -> _T:
        """``fetch`` from each of ``servers`` in turn until one answers; only a server that does
        not answer or answers 5xx is passed over (not for room this daemon lacks: ``_PutOff``,
        ``CapacityError``)."""
        error: FFPlaneError | None = None
        for server in servers:
            try:
                got = await fetch(server)
            except FFPlaneError as exc:
                if isinstance(exc, (_PutOff, CapacityError)) or not (isinstance(exc, TransportError) or exc.status >= 500):
                    raise
                self.servers.failed(server)
                error = exc
                continue
            self.servers.answered(server)
            return got
        assert error is not None
        raise error

    async def _download_from(self, server: str, stream: Stream, step: int, tmp: Path, final: Path) -> CachedFile:
        assert self._session is not None
        url = f"{server}/v1/jobs/{stream.job}/batches"
        headers = bearer(stream.token or self.token)
        params = {"dp_rank": str(stream.dp_rank), "start": str(step), "count": "1"}
        stream.requests += 1
        # Every byte is counted before it is written: the announced size up front, or, for a body
        # sent without one (a step over 16 MiB is streamed), what has arrived, chunk by chunk.
        with self._reservation(stream, step) as res:
            try:
                async with self._session.get(url, params=params, headers=headers) as resp:
                    if resp.status != 200:
                        detail = (await resp.text())[:500]
                        raise error_from(resp.status, f"data server answered {resp.status} for {stream.key} step {step}: {detail}")
                    res.size = resp.content_length
                    if res.size is not None:
                        stream.step_bytes = res.size
                        await self._hold(res, res.size)
                    received = 0

                    async def before_write(n: int) -> None:
                        nonlocal received
                        received += n
                        if res.size is None:  # what a step is at least, for the prefetch's estimate
                            stream.step_bytes = max(stream.step_bytes, received)
                        await self._hold(res, received)
                        if self.gate is not None:
                            await self._admit(res, n)

                    fd = shm.open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                    try:
                        shm.presize(fd, res.size or 0)
                        nbytes = await _copy_body(resp, fd, before_write)
                    finally:
                        os.close(fd)
                    if res.size is not None and nbytes != res.size:
                        raise TransportError(f"{stream.key} step {step}: body of {nbytes} bytes, Content-Length said {res.size}")
            except aiohttp.ClientError as exc:
                shm.unlink(tmp)
                raise TransportError(f"cannot fetch {stream.key} step {step} from {server}: {exc}") from exc
            except OSError as exc:  # ENOSPC: the tmpfs is full — a clear error, not a dropped reader
                shm.unlink(tmp)
                raise CapacityError(f"cannot cache {stream.key} step {step} in {self.config.root}: {exc}; the tmpfs is full") from exc
            except BaseException:
                shm.unlink(tmp)
                raise
            stream.step_bytes = nbytes
            gens = file_generations(tmp, 1)
            try:
                await self._check_plan(stream, step, gens)
            except BaseException:
                shm.unlink(tmp)
                raise
            return self._publish(res, tmp, final, nbytes, generations=gens)

    def _publish(
        self, res: _Reservation, tmp: Path, final: Path, nbytes: int, count: int = 1, generations: tuple[int, ...] | None = None
    ) -> CachedFile:
        """A file of ``count`` steps from ``res.step``, written whole under ``tmp``, becomes
        ``final`` and is recorded (with the generation each step was planned in); the fetch's
        room becomes the file's in the same breath."""
        stream = res.stream
        shm.publish(tmp, final)
        record: dict[str, Any] = {"file": str(final.relative_to(self.config.root)), "nbytes": nbytes}
        if count > 1:
            record["steps"] = count
        if generations is not None:
            record["generations"] = list(generations)
        self.index.put(_index_key(stream.job, stream.dp_rank, res.step), record)
        self.bytes_fetched += nbytes
        cached = CachedFile(final, nbytes, res.step, count, generations)
        stream.add(cached)
        self._release(res)
        return cached

    async def _admit(self, res: _Reservation, nbytes: int) -> None:
        assert self.gate is not None
        stream, step = res.stream, res.step

        def needed() -> bool:  # asked again while it waits: a prefetch becomes the next batch
            return bool(stream.readers) and step <= max(stream.readers.values()) + 1

        def urgent() -> bool:  # (a prefetch whose room was taken back goes through, to stop)
            return needed() or res.preempted

        await self.gate.acquire(Priority.NEXT_BATCH if needed() else Priority.PREFETCH, nbytes, critical=urgent)
        await self._hold(res, res.nbytes)  # stop here if its room was taken back while it waited

    # --- the job's plan --------------------------------------------------------------------
    async def check_plan(self, stream: Stream, wait_s: float | None = None) -> None:
        """Ask a data server for the job's generations and drop every cached file planned before
        them. Waits at most ``wait_s`` (the request goes on; its drop follows when it is answered)."""
        task = stream.plan_task
        if task is None or task.done():
            task = stream.plan_task = asyncio.create_task(self._refresh_plan(stream), name=f"plan {stream.key}")
        with suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), wait_s)
            return
        log.warning("job's plan not known yet; cached steps checked once it is", extra={"job": stream.job, "dp_rank": stream.dp_rank})

    async def _refresh_plan(self, stream: Stream) -> None:
        try:
            view = await self._failing_over(self.servers.for_step(stream.key, 0), lambda server: self._job_view(server, stream))
            plan = JobPlan.from_view(view)
        except (FFPlaneError, ValueError, KeyError, TypeError) as exc:
            level = logging.INFO if isinstance(exc, FFPlaneError) and exc.status == 404 else logging.WARNING
            log.log(level, "job's plan unavailable", extra={"job": stream.job, "dp_rank": stream.dp_rank, "error": str(exc)})
            return
        finally:
            stream.plan_at = time.monotonic()
        if plan != stream.plan:
            log.info("job's plan", extra={"job": stream.job, "dp_rank": stream.dp_rank, "generations": list(plan.starts)})
        stream.plan = plan
        self._drop_stale(stream)

    async def _job_view(self, server: str, stream: Stream) -> dict[str, Any]:
        assert self._session is not None
        try:
            async with self._session.get(f"{server}/v1/jobs/{stream.job}", headers=bearer(stream.token or self.token)) as resp:
                if resp.status != 200:
                    detail = (await resp.text())[:500]
                    raise error_from(resp.status, f"data server answered {resp.status} for job {stream.job!r}: {detail}")
                view: dict[str, Any] = await resp.json(content_type=None)
                return view
        except aiohttp.ClientError as exc:
            raise TransportError(f"cannot fetch job {stream.job!r} from {server}: {exc}") from exc

    async def _check_plan(self, stream: Stream, first: int, generations: tuple[int, ...] | None) -> None:
        """Refuse (``_Replanned``) fetched steps planned before the generation the job plans them
        in. Steps off the plan as last seen make the cache ask for it again first: the job may
        have gained a generation since (the steps are ahead of the plan, and kept), or the answer
        came from before one (they are behind it)."""
        plan = stream.plan
        if plan is None or plan.compare(first, generations) == CURRENT:
            return
        if time.monotonic() - stream.plan_at >= _PLAN_AGAIN_S:
            await self.check_plan(stream)
            plan = stream.plan
        assert plan is not None and generations is not None
        if plan.compare(first, generations) == STALE:
            raise _Replanned(
                f"{stream.key} steps {first}+{len(generations)} arrived planned in generations {sorted(set(generations))}; "
                f"the job plans them in {sorted({plan.generation(s) for s in range(first, first + len(generations))})}"
            )

    def _drop_stale(self, stream: Stream) -> None:
        """Drop the files holding a step planned before the generation the job now plans it in;
        the pump fetches them again."""
        plan = stream.plan
        stale = [] if plan is None else [f for f in stream.files.values() if plan.compare(f.first, f.generations) == STALE]
        for f in stale:
            stream.drop(f)
            shm.unlink(f.path)  # a reader still mapping it keeps its pages
        if stale:
            self.index.delete(*(_file_key(stream, f) for f in stale))
            first = min(f.first for f in stale)
            log.info("stale steps dropped", extra={"job": stream.job, "dp_rank": stream.dp_rank, "from_step": first, "files": len(stale)})
            stream.wake.set()

    def invalidate(self, stream: Stream, step: int) -> None:
        """Drop a cached step a reader found stale (planned before a new generation): the file
        holding it and every later cached step of the stream, which were planned the same way;
        they refetch."""
        stale = [f for f in stream.files.values() if f.end > step]
        for f in stale:
            stream.drop(f)
            shm.unlink(f.path)
        stream.failed.clear()
        stream.end_step = None
        if stale:
            self.index.delete(*(_file_key(stream, f) for f in stale))
            log.info("stale steps dropped", extra={"job": stream.job, "dp_rank": stream.dp_rank, "from_step": step, "files": len(stale)})

    # --- eviction ------------------------------------------------------------------------
    def _evict(self, stream: Stream) -> None:
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
            self.index.delete(*(_file_key(stream, f) for f in old))


def check_run(body: bytes, steps: list[int]) -> tuple[int, ...] | None:
    """ValueError unless ``body`` is one Arrow IPC stream holding exactly ``steps``' record
    batches, in order (each batch's ``step`` metadata says which): what a cached file of a run,
    read by ``trainer_client``'s daemon source, must be. Returns the generation each step was
    planned in (None: untagged)."""
    reader = pa.ipc.open_stream(pa.py_buffer(body))
    metas = []
    for step in steps:
        try:
            meta = reader.read_next_batch_with_custom_metadata().custom_metadata
        except StopIteration:
            raise ValueError(f"the stream ends before step {step}") from None
        said = None if meta is None else meta.get(b"step")
        if said != str(step).encode():
            raise ValueError(f"the stream's batch for step {step} says step {said!r}")
        metas.append(meta)
    try:
        reader.read_next_batch()
    except StopIteration:
        return generations_of(metas)
    raise ValueError(f"the stream holds more than the {len(steps)} steps asked for")
