"""The cache's bookkeeping of one stream (a job's dp rank): its readers, its published files and
the steps each holds, its fetches under way, and what it counts for the ops API."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ffplane_contract.errors import FFPlaneError
from ffplane_contract.plan import JobPlan


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


def index_key(job: str, dp_rank: int, step: int) -> str:
    """The index record of the file of ``job``'s ``dp_rank`` named for ``step``."""
    return f"data/{job}/{dp_rank}/{step:012d}"


def file_key(stream: Stream, cached: CachedFile) -> str:
    return index_key(stream.job, stream.dp_rank, cached.first)
