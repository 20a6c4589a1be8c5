"""A stream's fetches: the pump that keeps the readers' window fetched (``[slowest reader,
fastest reader + W)``, in step order: the step a reader waits on is always the lowest missing one,
so order is priority), and the fetch tasks behind each step's future — a step alone, or a run of
small steps in one request that, failing in any way, is fetched again step by step, so its errors
are exactly those of single fetches."""

from __future__ import annotations

import asyncio
import logging

from ffplane_contract.errors import FFPlaneError, error_from
from ffplane_contract.files import step_file
from statestore import shm
from statestore._cache_admission import PutOff
from statestore._cache_downloads import RUN_STEP_BYTES, Downloads
from statestore._cache_streams import CachedFile, Stream
from statestore.budget import Budget
from statestore.config import DaemonConfig

log = logging.getLogger("statestore.data_cache")  # (the cache's parts log as the cache: what operators filter on)


class Prefetch:
    """Fetches of the streams' steps through ``downloads``, at most ``config.fetch_concurrency``
    requests at once, each pass of the pump within what ``budget`` has free."""

    def __init__(self, config: DaemonConfig, budget: Budget, downloads: Downloads) -> None:
        self.config = config
        self.budget = budget
        self._downloads = downloads
        self._fetch_slots = asyncio.Semaphore(config.fetch_concurrency)

    # --- the pump ------------------------------------------------------------------------
    async def pump(self, stream: Stream) -> None:
        """Start the fetches of ``stream``'s window each time it is woken; runs until cancelled."""
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
                if not _missing(stream, step):
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
                    self.start_fetch(stream, step)
                else:
                    self._start_run(stream, run)

    def _run(self, stream: Stream, step: int) -> list[int]:
        """The consecutive missing steps from ``step`` one request fetches: up to ``fetch_steps``
        (the pump starts one while a missing step is within ``fetch_steps - 1`` past the window,
        so in a steady run each request brings ``fetch_steps`` new steps, a run ahead)."""
        end = step + self.config.fetch_steps
        if stream.end_step is not None:
            end = min(end, stream.end_step)
        run = [step]
        while run[-1] + 1 < end and _missing(stream, run[-1] + 1):
            run.append(run[-1] + 1)
        return run

    @staticmethod
    def _step_estimate(stream: Stream) -> int:
        return max(max((f.nbytes // f.count for f in stream.files.values()), default=0), stream.step_bytes)

    # --- a step alone --------------------------------------------------------------------
    def start_fetch(self, stream: Stream, step: int) -> asyncio.Future[CachedFile]:
        """Fetch ``step`` alone; the future of its file (also in ``stream.inflight`` meanwhile)."""
        fut: asyncio.Future[CachedFile] = asyncio.get_running_loop().create_future()
        stream.inflight[step] = fut
        task = asyncio.create_task(self._fetch(stream, step, fut), name=f"fetch {stream.key}/{step}")
        task.add_done_callback(lambda t: None if t.cancelled() else t.exception())
        return fut

    async def _fetch(self, stream: Stream, step: int, fut: asyncio.Future[CachedFile]) -> None:
        try:
            async with self._fetch_slots:
                cached = await self._downloads.download(stream, [step])
            stream.fetched += 1
            fut.set_result(cached)
        except FFPlaneError as exc:
            if not isinstance(exc, PutOff):  # a put-off prefetch is tried again once there is room
                stream.failed[step] = exc
            fut.set_exception(exc)
            fut.exception()  # retrieved here; waiters get it from stream.failed / the future
            level = logging.INFO if isinstance(exc, PutOff) else logging.WARNING
            if exc.status == 416:  # past the job's end: stop prefetching there; said once a stream
                level = logging.INFO if stream.end_step is None else logging.DEBUG
                stream.end_step = step if stream.end_step is None else min(step, stream.end_step)
            log.log(level, "fetch failed", extra={"job": stream.job, "dp_rank": stream.dp_rank, "step": step, "error": str(exc)})
        except BaseException as exc:
            if not fut.done():
                fut.cancel()
            shm.unlink(shm.tmp_path(stream.directory / step_file(step)))  # (a crash past the download's own cleanup)
            if not isinstance(exc, asyncio.CancelledError):
                log.exception("fetch crashed", extra={"job": stream.job, "step": step})
            raise
        finally:
            stream.inflight.pop(step, None)
            stream.wake.set()

    # --- a run of small steps ------------------------------------------------------------
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
                got = await self._downloads.download(stream, steps)
        except PutOff as exc:  # no room now: the whole run waits, as a single prefetch would
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
        await self._fetch_one_by_one(stream, steps, futs)

    async def _fetch_one_by_one(self, stream: Stream, steps: list[int], futs: list[asyncio.Future[CachedFile]]) -> None:
        for step, fut in zip(steps, futs):
            if stream.end_step is not None and step >= stream.end_step:  # found by a step before it: not asked again
                stream.inflight.pop(step, None)
                fut.set_exception(error_from(416, f"{stream.key} step {step} is past the job's end ({stream.end_step} steps)"))
                fut.exception()
                continue
            await self._fetch(stream, step, fut)
        stream.wake.set()


def _missing(stream: Stream, step: int) -> bool:
    return step not in stream.ready and step not in stream.inflight and step not in stream.failed
