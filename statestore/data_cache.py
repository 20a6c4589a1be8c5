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

``DataCache`` composes its parts: the streams' bookkeeping (``_cache_streams``), their room in the
budget and eviction (``_cache_admission``), the pump and fetch tasks (``_cache_prefetch``), the
requests to data servers and the publishing of files (``_cache_downloads``), and the job's plan
(``_cache_plans``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from pathlib import Path

from ffplane_contract.dataserver_http import JobView
from ffplane_contract.errors import FFPlaneError, FFTimeoutError, TransportError
from ffplane_contract.plan import STALE
from statestore import shm
from statestore._cache_admission import Admission
from statestore._cache_downloads import Downloads, check_run
from statestore._cache_plans import Plans, Replanned
from statestore._cache_prefetch import Prefetch
from statestore._cache_streams import CachedFile, Stream
from statestore.budget import CACHE_HOLDER, Budget
from statestore.config import DaemonConfig
from statestore.dataservers import DataServers
from statestore.index import Index
from statestore.job_plans import file_generations
from statestore.link_gate import LinkGate

__all__ = ["CachedFile", "DataCache", "Stream", "check_run"]

# A data server restarting or briefly unreachable is not the reader's problem, nor one answering
# from before a new generation; a step that cannot fit the budget will not fit in a moment either.
_RETRIED = (TransportError, FFTimeoutError, Replanned)


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
        self.gate = gate  # fetches wait at it (none: they never wait)
        self.streams: dict[tuple[str, int], Stream] = {}
        self._admission = Admission(config, budget, index, gate, self.streams)
        self._plans = Plans(index, self._job_view)
        self._downloads = Downloads(config, servers, token, index, self._admission, self._plans.check)
        self._prefetch = Prefetch(config, budget, self._downloads)
        budget.register(CACHE_HOLDER, self.cached_bytes)

    @property
    def bytes_fetched(self) -> int:
        """Bytes of every file the cache published since it started."""
        return self._downloads.bytes_fetched

    @property
    def peak_bytes(self) -> int:
        """The most the cache ever held (or had reserved) at once: at most the budget."""
        return self._admission.peak_bytes

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
        self._admission.note_peak()
        return kept, dropped

    def shrink(self, to_bytes: int) -> int:
        """Drop cached files no reader is on until the cache holds at most ``to_bytes``; the
        bytes dropped."""
        before = self.cached_bytes()
        self._admission.evict_victims(lambda: self.cached_bytes() <= to_bytes)
        return before - self.cached_bytes()

    def cached_bytes(self) -> int:
        """Bytes the cache holds: its files, and the room of the fetches under way."""
        return self._admission.cached_bytes()

    async def start(self) -> None:
        await self._downloads.start()

    async def close(self) -> None:
        for stream in self.streams.values():
            if stream.pump is not None:
                stream.pump.cancel()
        for stream in self.streams.values():
            for fut in stream.inflight.values():
                fut.cancel()
        await self._downloads.close()

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
            stream.pump = asyncio.create_task(self._prefetch.pump(stream), name=f"pump {stream.key}")
        return stream

    def detach(self, reader: int, stream: Stream) -> None:
        stream.readers.pop(reader, None)

    async def get(self, reader: int, stream: Stream, step: int) -> tuple[CachedFile, bool]:
        """The cached file holding ``step``, waiting for it if needed; also moves the reader's cursor."""
        stream.readers[reader] = step
        # Eviction (unlinks, an index transaction) runs after the reply is sent, not before it.
        asyncio.get_running_loop().call_soon(self._admission.evict, stream)
        stream.wake.set()
        cached = stream.ready.get(step)
        if cached is not None and stream.plan is not None and stream.plan.compare(cached.first, cached.generations) == STALE:
            self._plans.drop_stale(stream)  # (dropped when the plan changed; this one published since)
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
                fut = stream.inflight.get(step) or self._prefetch.start_fetch(stream, step)
                try:
                    return await asyncio.shield(fut), False
                except FFPlaneError as exc:
                    stream.failed.pop(step, None)
                    if not isinstance(exc, _RETRIED) or time.perf_counter() - started > self.config.fetch_retry_s:
                        raise
                    await asyncio.sleep(0.2)
        finally:
            stream.wait_s += time.perf_counter() - started

    # --- the job's plan --------------------------------------------------------------------
    async def check_plan(self, stream: Stream, wait_s: float | None = None) -> None:
        """Ask a data server for the job's generations and drop every cached file planned before
        them. Waits at most ``wait_s`` (the request goes on; its drop follows when it is answered)."""
        await self._plans.check_plan(stream, wait_s)

    def _job_view(self, stream: Stream) -> Awaitable[JobView]:
        return self._downloads.job_view(stream)  # (the plans are made before the downloads, which check against them)
