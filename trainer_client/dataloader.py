"""The ffplane DataLoader: this worker's batches, step by step, from the node cache."""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait
from typing import Any

import torch

from ffplane_contract import files
from ffplane_contract.auth import load_token
from ffplane_contract.errors import CorruptError, FFPlaneError, FFTimeoutError, TransportError
from ffplane_contract.servers import DATASERVER_ENV
from trainer_client._device_copy import StagedBatch, stage
from trainer_client._sources import DaemonSource, HttpSource, Step
from trainer_client.batches import Batch, StepBytes
from trainer_client.events import emit, enabled
from trainer_client.pinned import cuda_present
from trainer_client.state_codec import LOADER_KIND

log = logging.getLogger(__name__)

_HELD_STEPS = 2  # steps handed out whose mapping the loader still holds (released by the look-ahead)
_Fetched = tuple[Step, "StagedBatch | None"]  # a step, and its device (or page-locked) copy


class DataLoader:
    """Iterates the batches of ``(job, dp_rank)`` from ``start_step`` as dicts of torch tensors.

    Fixed-width numeric columns (token arrays, labels) arrive as tensors viewing the node cache's
    shared memory (no copy); binary columns as lists of memoryviews. ``transform`` runs on each
    batch before it is yielded. With no daemon on the node (or when it stops answering and does
    not come back within ``reconnect_s``), batches come straight from the data server.

    A step is an optimizer step: with ``micro_batches=k`` (gradient accumulation) each step's
    batch comes as ``k`` micro-batches, its rows split as evenly as they go, so the job's
    ``max_steps`` counts optimizer steps.

    ``device="cuda"``: tensor columns arrive on that device. The look-ahead thread copies the
    next step while the current one trains (into page-locked host memory, then non-blocking onto
    the device on a side stream); the training thread gets tensors whose copy has completed.
    ``pin_memory=True`` on a CPU loader hands out page-locked copies (as torch's DataLoader does),
    so the caller's own ``.to(device, non_blocking=True)`` runs asynchronously; without CUDA it
    does nothing.

    ``state_dict()`` is the position: the step the loader continues at. Saved with step ``s``
    through ``Checkpointer.save(s, ...)``, it is bound to that step — the restored run continues
    at ``s + 1`` even when the loop had already fetched the next step's batch (nanoGPT fetches
    it before ``optimizer.step()``) — and a position that does not follow ``s`` is refused.
    """

    def __init__(
        self,
        job: str,
        dp_rank: int,
        *,
        dataserver: str | None = None,
        token: str | None = None,
        socket_path: str | os.PathLike[str] | None = None,
        start_step: int = 0,
        end_step: int | None = None,
        transform: Callable[[Batch], Any] | None = None,
        timeout_s: float = 120.0,
        reconnect_s: float = 5.0,
        http_window: int = 4,
        micro_batches: int = 1,
        device: str | torch.device | None = None,
        pin_memory: bool = False,
    ) -> None:
        self.device = _device(device)
        self.pin_memory = pin_memory and cuda_present()
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches=}")
        self.micro_batches = micro_batches
        if dp_rank < 0:
            raise ValueError(f"dp_rank must be >= 0, got {dp_rank=}")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step=}")
        self.job, self.dp_rank = job, dp_rank
        self.dataserver = dataserver or os.environ.get(DATASERVER_ENV)
        self.token = token if token is not None else load_token()  # $FFPLANE_TOKEN_FILE, else $FFPLANE_TOKEN
        self.socket_path = files.socket_path(socket_path)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s=}")
        self.transform = transform
        self.timeout_s, self.reconnect_s, self.http_window = timeout_s, reconnect_s, http_window
        self._next_step = start_step
        self._served = False  # for the recovery timeline: the first batch handed out
        self._source: DaemonSource | HttpSource | None = None
        self._http: HttpSource | None = None
        self._pool: ThreadPoolExecutor | None = None
        # the step looked ahead at, and the look-ahead thread's fetch of it (None: ``_here`` said it
        # is read on the training thread; nothing calls the source before that read)
        self._ahead: tuple[int, Future[_Fetched] | None] | None = None
        # Each step handed out, held until the look-ahead thread drops it two steps later. A
        # step's mapping is unmapped by whoever drops the last reference: without this, the
        # training thread did, the moment its loop let go of the previous batch — a munmap with a
        # TLB shootdown to the other core, in the middle of the step. bench/reader_steps.py: 0.79
        # → 0.65 ms per cached 4 MiB step (docs/decisions.md, "Data path, fourth pass").
        self._held: deque[tuple[StepBytes, StagedBatch | None]] = deque()
        self.end_step = end_step
        self._generations: list[int] = []  # start steps of the job's generations, when known
        if self.dataserver:
            self._refresh_job(set_end=end_step is None)

    # --- sources -------------------------------------------------------------------------
    def _http_source(self) -> HttpSource:
        if self._http is None:
            if not self.dataserver:
                raise TransportError(
                    f"no statestore daemon at {self.socket_path} and no data server configured; "
                    f"start the daemon or pass dataserver= (or set {DATASERVER_ENV})"
                )
            self._http = HttpSource(self.dataserver, self.job, self.dp_rank, self.token, self.timeout_s, self.http_window)
        self._http.end_step = self.end_step
        return self._http

    def _connect(self) -> DaemonSource | HttpSource:
        deadline = time.monotonic() + self.reconnect_s
        while True:
            try:
                return DaemonSource(self.socket_path, self.job, self.dp_rank, self.token, self.timeout_s)
            except TransportError as exc:
                if time.monotonic() >= deadline or not self.socket_path.exists():
                    log.warning("reading from the data server: %s", exc, extra={"job": self.job, "dp_rank": self.dp_rank})
                    return self._http_source()
                time.sleep(0.1)

    @property
    def source(self) -> str:
        """``"daemon"`` or ``"dataserver"``: where batches are coming from now."""
        return "none" if self._source is None else self._source.name

    def _refresh_job(self, set_end: bool = False) -> None:
        info = self._http_source().job_info()
        self._generations = sorted(int(g["start_step"]) for g in info.get("generations", []))
        if set_end:
            self.end_step = info.get("max_steps")

    def _expected_generation(self, step: int) -> int | None:
        starts = [g for g in self._generations if g <= step]
        return starts[-1] if starts else None

    def _fetch(self, step: int, here: bool = False) -> _Fetched:
        """Step ``step``: on the look-ahead thread, or ``here`` on the training thread when
        ``_here`` says it is in the file mapped already."""
        mapped = self._source.mapped if here and isinstance(self._source, DaemonSource) else None
        while len(self._held) > _HELD_STEPS:  # on the look-ahead thread: unmapped here
            if here and self._held[0][0] is not mapped:
                break  # it may be a file's last reference: its unmap waits for the look-ahead thread
            _, staged = self._held.popleft()
            if staged is not None:
                staged.release()  # its copy done before the unmap
        found = self._fetch_plan_checked(step)
        if self.device is None and not self.pin_memory:
            return found, None
        # one step ahead: the copy onto the device runs while the training thread computes
        return found, stage(found[0].to_torch(found[1]), self.device)

    def _fetch_plan_checked(self, step: int) -> Step:
        found = self._fetch_any(step)
        if not self._generations:
            return found
        # A node cache may hold a step planned before an elastic change (a new generation from
        # a step it had already prefetched): check the batch's generation, refetch if stale.
        for attempt in range(3):
            got = int(found[2].get("generation", -1))
            if got == self._expected_generation(step):
                return found
            if attempt == 0 and got > (self._expected_generation(step) or -1):
                self._refresh_job()  # the job gained a generation after this loader started
            elif isinstance(self._source, DaemonSource):
                self._source.invalidate(step)
            found = self._fetch_any(step)
        raise CorruptError(
            f"step {step} of job {self.job!r} keeps arriving from generation {found[2].get('generation')}, the job says {self._expected_generation(step)}"
        )

    def _fetch_any(self, step: int) -> Step:
        if self._source is None:
            self._source = self._connect()
        try:
            return self._source.get(step)
        except TransportError:
            if not isinstance(self._source, DaemonSource):
                raise
            self._source.close()  # the daemon died or restarted: reconnect, else go direct
            self._source = self._connect()
            return self._source.get(step)

    def _here(self, step: int) -> bool:
        """Whether ``step`` is read on the training thread: it is in the cache file the source
        has mapped already (a run of small steps: no system call to make), with nothing to stage
        on a device or pin. Handing such a step to the look-ahead thread cost more than reading
        it: a wake-up, a switch and a wait for the GIL each step (docs/decisions.md, "The DataLoader's
        look-ahead thread")."""
        src = self._source
        return self.device is None and not self.pin_memory and isinstance(src, DaemonSource) and src.has(step)

    def _get(self, step: int) -> _Fetched:
        """Step ``step``, fetched by the look-ahead thread (``_prefetch`` starts it on the next),
        or read here when ``_here``.

        Every source call happens on one thread at a time (the look-ahead thread's call is over
        before the training thread makes one), so sources need no locking; the look-ahead
        thread's exceptions re-raise here, in the training thread.
        """
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"ffplane-loader-{self.job}-{self.dp_rank}")
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == step:
            if ahead[1] is None:
                return self._fetch(step, here=True)
            fut = ahead[1]
        else:
            if ahead is not None and ahead[1] is not None:  # a look-ahead for another step (the loop jumped): let it finish
                futures_wait([ahead[1]], timeout=self.timeout_s)
            if self._here(step):
                return self._fetch(step, here=True)
            fut = self._pool.submit(self._fetch, step)
        try:
            result = fut.result(timeout=self.timeout_s)
        except FutureTimeout as exc:
            raise FFTimeoutError(f"step {step} of job {self.job!r} dp_rank {self.dp_rank} not ready after {self.timeout_s}s") from exc
        return result

    def _prefetch(self, step: int) -> None:
        """Start the look-ahead thread on ``step``. Called once the training thread has done
        its own Python for the current step (tensor views, events): the thread takes the GIL
        for its own Python as soon as it wakes, so started earlier it ran while the training
        thread waited for the GIL rather than while it computed (bench/reader_steps.py measures
        the wait; docs/decisions.md, "Data path, third pass")."""
        assert self._pool is not None
        if self.end_step is None or step < self.end_step:
            self._ahead = (step, None if self._here(step) else self._pool.submit(self._fetch, step))

    # --- iteration -----------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        while self.end_step is None or self._next_step < self.end_step:
            step = self._next_step
            (step_bytes, batch, _meta), staged = self._get(step)
            self._held.append((step_bytes, staged))
            out = staged.take() if isinstance(staged, StagedBatch) else step_bytes.to_torch(batch)
            if not self._served:
                self._served = True
                emit("data_ready", step=step)
            if enabled(logging.DEBUG):  # the timeline's per-step record; its consumer reads the batch
                emit("batch", logging.DEBUG, step=step, batch=out)
            self._next_step = step + 1
            self._prefetch(step + 1)
            for part in _split(out, self.micro_batches):
                yield self.transform(part) if self.transform else part

    def __len__(self) -> int:
        if self.end_step is None:
            raise TypeError("this DataLoader is unbounded (the job has no max_steps)")
        return max(0, self.end_step - self._next_step)

    @property
    def next_step(self) -> int:
        return self._next_step

    def state_dict(self) -> dict[str, Any]:
        """The position; ``kind`` lets ``Checkpointer.save`` bind it to the saved step."""
        return {"kind": LOADER_KIND, "job": self.job, "dp_rank": self.dp_rank, "next_step": self._next_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state["next_step"]``; refuses a state saved for another job or dp rank."""
        missing = {"job", "dp_rank", "next_step"} - set(state)
        if missing:
            raise FFPlaneError(f"DataLoader state lacks {sorted(missing)}")
        if state["job"] != self.job or state["dp_rank"] != self.dp_rank:
            raise FFPlaneError(
                f"state is for job {state['job']!r} dp_rank {state['dp_rank']}, this loader reads job {self.job!r} dp_rank {self.dp_rank}"
            )
        step = state["next_step"]
        if not isinstance(step, int) or step < 0:
            raise FFPlaneError(f"next_step must be a non-negative int, got {step!r}")
        self._next_step = step

    def close(self) -> None:
        """Stop the look-ahead thread and disconnect; safe to call twice."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool, self._ahead = None, None
        for _, staged in self._held:
            if staged is not None:
                staged.release()
        self._held.clear()
        for src in (self._source, self._http):
            if src is not None:
                src.close()
        self._source = None


def _device(device: str | torch.device | None) -> torch.device | None:
    """The device tensor columns are moved to (None: they stay where the cache maps them)."""
    if device is None:
        return None
    dev = torch.device(device)
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        raise ValueError(f"DataLoader(device={device!r}): batches go to 'cpu' or a CUDA device")
    if not cuda_present():
        raise ValueError(f"DataLoader(device={device!r}): torch sees no CUDA device here; pass device='cpu' (or leave it out)")
    # resolved here, on the training thread: the look-ahead thread's current device is always 0
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


def _split(batch: Any, k: int) -> list[Any]:
    """``batch``'s rows in ``k`` consecutive parts (views; sizes differ by at most one row)."""
    if k == 1:
        return [batch]
    if not isinstance(batch, dict):
        raise TypeError(f"micro_batches={k} splits a batch of columns; got a {type(batch).__name__}")
    rows = {len(v) for v in batch.values()}
    if len(rows) != 1:
        raise ValueError(f"the batch's columns have different lengths {sorted(rows)}; cannot split it into micro-batches")
    n = rows.pop()
    if n < k:
        raise ValueError(f"a step of {n} rows cannot be split into micro_batches={k}")
    bounds = [n * i // k for i in range(k + 1)]
    return [{name: col[bounds[i] : bounds[i + 1]] for name, col in batch.items()} for i in range(k)]
