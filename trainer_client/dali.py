"""A DALI source over the node cache: this worker's batches, in plan order, into a DALI pipeline.

``CacheSource`` is the callable for ``fn.external_source`` in batch mode: each call is one step
(or one of its micro-batches) of ``(job, dp_rank)``, read from the node cache through a
``DataLoader``, one output per named column — a binary column (encoded images) as a list of
``uint8`` arrays viewing the cached step's pages, a numeric column as one array of shape
``(rows, ...)`` viewing them too. With ``no_copy=True`` DALI reads those pages in place; the
source keeps the last ``keep`` batches alive for it (DALI's prefetch queue holds them until it
has run them). A batch is never dropped: one with fewer rows than the pipeline's ``batch_size``
(micro-batches of a step that does not split evenly, a smaller batch after an elastic change)
goes through as it is; one with more is refused with the numbers to change.

``DaliLoader`` runs the pipeline and counts what training has consumed: its ``state_dict()`` is
the position, bound to the saved step by ``Checkpointer.save`` like a DataLoader's, and
``load_state_dict`` resumes there (before the first batch: DALI prefetches from the source).

    source = CacheSource("imagenet", dp_rank, columns=("jpeg", "label"))

    @pipeline_def(batch_size=source.rows_per_batch, num_threads=4, device_id=local_rank)
    def images():
        jpegs, labels = fn.external_source(source=source, num_outputs=2, batch=True, no_copy=True,
                                           dtype=[types.UINT8, types.INT64])
        return fn.decoders.image(jpegs, device="mixed"), labels

    loader = DaliLoader(images(), source)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from ffplane_contract.errors import FFPlaneError
from trainer_client.dataloader import DataLoader
from trainer_client.state_codec import LOADER_KIND

__all__ = ["CacheSource", "DaliLoader"]

Column = np.ndarray | list[np.ndarray]


class CacheSource:
    """``fn.external_source(source=CacheSource(...), num_outputs=len(columns), batch=True)``.

    ``loader_options`` go to the ``DataLoader`` that reads the cache (``dataserver``, ``token``,
    ``socket_path``, ``start_step``, ``end_step``, ``micro_batches``, ...)."""

    def __init__(self, job: str, dp_rank: int, columns: Sequence[str], *, keep: int = 4, **loader_options: Any) -> None:
        if not columns:
            raise ValueError("CacheSource needs the names of the columns to feed (e.g. columns=('jpeg', 'label'))")
        if keep < 2:
            raise ValueError(f"keep must be >= 2 (DALI's prefetch queue holds batches it has not run), got {keep}")
        if "device" in loader_options or "transform" in loader_options:
            raise ValueError("CacheSource feeds host memory to DALI: decode and move data inside the pipeline, not in the loader")
        self.loader = DataLoader(job, dp_rank, **loader_options)
        self.columns = tuple(columns)
        self.batch_size: int | None = None  # the pipeline's, once DaliLoader knows it
        self._iter: Iterator[Any] | None = None
        self._alive: deque[tuple[Column, ...]] = deque(maxlen=keep)  # what DALI may still read in place
        self.fed = 0  # batches handed to DALI

    @property
    def rows_per_batch(self) -> int:
        """The most rows one call can return: the job's rows per step for this rank (split by
        ``micro_batches``), for the pipeline's ``batch_size``."""
        from trainer_client.jobs import Jobs

        info = Jobs(self.loader.dataserver, self.loader.token).get(self.loader.job)
        rows = max(g.batch_per_rank for g in info.generations)
        return -(-rows // self.loader.micro_batches)

    def __call__(self) -> tuple[Column, ...]:
        if self._iter is None:
            self._iter = iter(self.loader)
        batch = next(self._iter)  # StopIteration ends DALI's epoch: the job's last step was fed
        missing = [c for c in self.columns if c not in batch]
        if missing:
            raise FFPlaneError(f"job {self.loader.job!r} has no column {missing}; its batches have {sorted(batch)}")
        out = tuple(_host_column(batch[c]) for c in self.columns)
        rows = len(out[0])
        if self.batch_size is not None and rows > self.batch_size:
            raise FFPlaneError(
                f"a batch of job {self.loader.job!r} has {rows} rows, more than the pipeline's batch_size={self.batch_size}: "
                "build the pipeline with batch_size=source.rows_per_batch (or read with micro_batches=k)"
            )
        self._alive.append(out)
        self.fed += 1
        return out

    def close(self) -> None:
        self._alive.clear()
        self.loader.close()


def _host_column(col: torch.Tensor | list[Any]) -> Column:
    if isinstance(col, torch.Tensor):
        return col.numpy()  # a view of the cached step: zero-copy
    return [np.frombuffer(m, dtype=np.uint8) for m in col]  # memoryviews into the step: zero-copy


class DaliLoader:
    """Iterates ``pipeline``'s outputs (one run per batch the ``source`` feeds) until the job's
    last step; ``state_dict``/``load_state_dict`` are the position, like a DataLoader's."""

    def __init__(self, pipeline: Any, source: CacheSource) -> None:
        self.pipeline, self.source = pipeline, source
        self.source.batch_size = int(pipeline.max_batch_size)
        self._start = source.loader.next_step
        self._consumed = 0  # pipeline runs handed to the caller
        self._built = False

    def __iter__(self) -> Iterator[Any]:
        if not self._built:
            self.pipeline.build()
            self._built = True
        while True:
            try:
                outputs = self.pipeline.run()
            except StopIteration:
                return
            self._consumed += 1
            yield outputs

    @property
    def next_step(self) -> int:
        """The step whose batch comes next (a step's micro-batches all count as that step)."""
        per_step = self.source.loader.micro_batches
        return self._start + -(-self._consumed // per_step)

    def state_dict(self) -> dict[str, Any]:
        loader = self.source.loader
        return {"kind": LOADER_KIND, "job": loader.job, "dp_rank": loader.dp_rank, "next_step": self.next_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state["next_step"]``; only before the first batch (DALI reads ahead)."""
        if self._built:
            raise FFPlaneError("DaliLoader.load_state_dict after iterating: DALI has read ahead; restore before the first batch")
        self.source.loader.load_state_dict(state)
        self._start, self._consumed = self.source.loader.next_step, 0

    def close(self) -> None:
        self.source.close()
