"""The cache kept to the job's plan (``job_plans``): each stream asks a data server for the job's
generations (on a reader's ``open``, and when a fetched step is off the plan as last seen), drops
the files planned before them, and refuses fetched steps still behind the plan."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress

from ffplane_contract.dataserver_http import JobView
from ffplane_contract.errors import CorruptError, FFPlaneError
from ffplane_contract.plan import CURRENT, STALE, JobPlan
from statestore import shm
from statestore._cache_streams import Stream, file_key
from statestore.index import Index

log = logging.getLogger("statestore.data_cache")  # (the cache's parts log as the cache: what operators filter on)

_PLAN_AGAIN_S = 1.0  # a fetched step off the job's plan asks the data server for the plan at most this often a stream


class Replanned(CorruptError):
    """A fetched step planned before the generation the job now plans it in (the data server
    answered before an elastic change): not published; a reader waiting on it fetches it again."""


class Plans:
    """Each stream's plan, as ``ask`` (a data server's job view) says; stale files dropped from
    ``index`` and the shared memory."""

    def __init__(self, index: Index, ask: Callable[[Stream], Awaitable[JobView]]) -> None:
        self.index = index
        self._ask = ask

    async def check_plan(self, stream: Stream, wait_s: float | None = None) -> None:
        """Ask a data server for the job's generations and drop every cached file planned before
        them. Waits at most ``wait_s`` (the request goes on; its drop follows when it is answered)."""
        task = stream.plan_task
        if task is None or task.done():
            task = stream.plan_task = asyncio.create_task(self._refresh(stream), name=f"plan {stream.key}")
        with suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), wait_s)
            return
        log.warning("job's plan not known yet; cached steps checked once it is", extra={"job": stream.job, "dp_rank": stream.dp_rank})

    async def _refresh(self, stream: Stream) -> None:
        try:
            plan = JobPlan.from_view(await self._ask(stream))
        except (FFPlaneError, ValueError) as exc:  # (a pydantic ValidationError is a ValueError)
            level = logging.INFO if isinstance(exc, FFPlaneError) and exc.status == 404 else logging.WARNING
            log.log(level, "job's plan unavailable", extra={"job": stream.job, "dp_rank": stream.dp_rank, "error": str(exc)})
            return
        finally:
            stream.plan_at = time.monotonic()
        if plan != stream.plan:
            log.info("job's plan", extra={"job": stream.job, "dp_rank": stream.dp_rank, "generations": list(plan.starts)})
        stream.plan = plan
        self.drop_stale(stream)

    async def check(self, stream: Stream, first: int, generations: tuple[int, ...] | None) -> None:
        """Refuse (``Replanned``) fetched steps planned before the generation the job plans them
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
            raise Replanned(
                f"{stream.key} steps {first}+{len(generations)} arrived planned in generations {sorted(set(generations))}; "
                f"the job plans them in {sorted({plan.generation(s) for s in range(first, first + len(generations))})}"
            )

    def drop_stale(self, stream: Stream) -> None:
        """Drop the files holding a step planned before the generation the job now plans it in;
        the pump fetches them again."""
        plan = stream.plan
        stale = [] if plan is None else [f for f in stream.files.values() if plan.compare(f.first, f.generations) == STALE]
        for f in stale:
            stream.drop(f)
            shm.unlink(f.path)  # a reader still mapping it keeps its pages
        if stale:
            self.index.delete(*(file_key(stream, f) for f in stale))
            first = min(f.first for f in stale)
            log.info("stale steps dropped", extra={"job": stream.job, "dp_rank": stream.dp_rank, "from_step": first, "files": len(stale)})
            stream.wake.set()
