"""The ffplane DataLoader: this worker's batches, step by step, from the node cache."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ffplane_contract import files
from ffplane_contract.auth import load_token
from ffplane_contract.errors import FFPlaneError
from ffplane_contract.servers import DATASERVER_ENV
from trainer_client._loader.generations import GenerationCheck, job_plan
from trainer_client._loader.look_ahead import LookAhead
from trainer_client._loader.micro_batches import MicroBatches
from trainer_client._loader.part import Stage
from trainer_client._loader.placement import Placement, resolve_device
from trainer_client._loader.source import StepSource
from trainer_client.batches import Batch
from trainer_client.events import emit, enabled
from trainer_client.pinned import cuda_present
from trainer_client.state_codec import LOADER_KIND

log = logging.getLogger(__name__)


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

    Assembled from small parts, each resumable on its own (``trainer_client._loader``): the
    source (daemon or data server), the generation check of steps read from the data server (the
    daemon checks its own cache), placement (pinning, a device), the look-ahead thread, and the
    micro-batch split; the loader adds the hand-out of each step (the timeline's records, its
    position) and ``transform``.
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
        self.device = resolve_device(device)
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
        self._source = StepSource(
            job,
            dp_rank,
            socket_path=self.socket_path,
            dataserver=self.dataserver,
            token=self.token,
            timeout_s=timeout_s,
            reconnect_s=reconnect_s,
            http_window=http_window,
            next_step=start_step,
            end_step=end_step,
        )
        plan = None  # the job's generations, when known
        if self.dataserver:
            info = self._source.job_info()
            plan = job_plan(info)
            if end_step is None:
                self._source.end_step = info.get("max_steps")
        placed = Placement(GenerationCheck(self._source, plan), self.device, self.pin_memory)
        self._ahead = LookAhead(
            placed, what=f"job {job!r} dp_rank {dp_rank}", thread_name=f"ffplane-loader-{job}-{dp_rank}", timeout_s=timeout_s
        )
        self._parts = MicroBatches(_HandOut(self, self._ahead), micro_batches)

    @property
    def source(self) -> str:
        """``"daemon"`` or ``"dataserver"``: where batches are coming from now."""
        return self._source.name

    @property
    def end_step(self) -> int | None:
        """The step the loader stops before (the job's ``max_steps`` unless ``end_step=`` said)."""
        return self._source.end_step

    # --- iteration -----------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        parts, transform = self._parts, self.transform
        while True:
            try:
                part = parts.next()
            except StopIteration:
                return
            yield transform(part) if transform else part

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
        self._parts.reset({"next_step": step})
        self._next_step = step

    def close(self) -> None:
        """Stop the look-ahead thread and disconnect; safe to call twice."""
        self._parts.close()


class _HandOut(Stage[Batch]):
    """The loader's own part of a step, between the look-ahead and the micro-batch split: the step
    taken as tensors, the loader's position moved past it, the recovery timeline's records, and
    then the look-ahead started on the next step (after this Python: see ``LookAhead``)."""

    def __init__(self, loader: DataLoader, ahead: LookAhead) -> None:
        super().__init__(ahead)
        self.loader, self.ahead = loader, ahead
        self._served = False  # the first batch handed out (the timeline's data_ready)

    def next(self) -> Batch:
        item = self.ahead.take()
        out = item.tensors()
        if not self._served:
            self._served = True
            emit("data_ready", step=item.step)
        if enabled(logging.DEBUG):  # the timeline's per-step record; its consumer reads the batch
            emit("batch", logging.DEBUG, step=item.step, batch=out)
        self.loader._next_step = item.step + 1
        self.ahead.look_ahead()
        return out
