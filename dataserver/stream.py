"""The batch wire format: one Arrow IPC stream, one record batch per step.

Each record batch carries the step's samples plus ``_sample_index`` (dataset row of each sample)
and custom metadata ``step``, ``epoch``, ``dp_rank`` and ``generation`` (its start step), so any
Arrow reader can consume and audit it. Encoding hands the body buffers to the HTTP layer as they
are produced; small IPC framing pieces are coalesced so the socket sees few, large writes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import pyarrow as pa
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from dataserver.catalog import with_sample_index
from dataserver.dataset import Dataset
from dataserver.planner import Planner

MEDIA_TYPE = "application/vnd.apache.arrow.stream"
_COALESCE = 64 << 10


class _Chunks:
    """A write-only file object that collects what the IPC writer emits."""

    closed = False

    def __init__(self) -> None:
        self.parts: list[bytes | memoryview] = []

    def write(self, data: bytes | pa.Buffer) -> int:
        # Arrow hands large body buffers over as pa.Buffer (no copy); a memoryview of it is what
        # the HTTP layer can send, still without a copy.
        part = data if isinstance(data, bytes) else memoryview(data)
        self.parts.append(part)
        return len(part)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def drain(self) -> Iterator[bytes | memoryview]:
        small: list[bytes | memoryview] = []
        for part in self.parts:
            if len(part) < _COALESCE:
                small.append(part)
                continue
            if small:
                yield b"".join(small)
                small = []
            yield part
        if small:
            yield b"".join(small)
        self.parts = []


def step_batch(dataset: Dataset, planner: Planner, dp_rank: int, step: int) -> tuple[pa.RecordBatch, dict[str, str]]:
    plan = planner.plan(dp_rank, step)
    batch = with_sample_index(dataset.take(plan.indices), plan.indices)
    meta = {
        "step": str(step),
        "epoch": str(plan.epoch),
        "dp_rank": str(dp_rank),
        "generation": str(plan.generation.start_step),
    }
    return batch, meta


class StepEncoder:
    """One Arrow IPC stream of ``dp_rank``'s steps, encoded a step per call: the caller decides
    where each step's work runs (on the event loop for small steps, on a thread for big ones)."""

    def __init__(self, dataset: Dataset, planner: Planner, dp_rank: int) -> None:
        self.dataset, self.planner, self.dp_rank = dataset, planner, dp_rank
        self._sink = _Chunks()
        self._writer: pa.ipc.RecordBatchStreamWriter | None = None

    def step(self, step: int) -> list[bytes | memoryview]:
        """The stream's bytes for ``step`` (the stream's header first, for the first step)."""
        batch, meta = step_batch(self.dataset, self.planner, self.dp_rank, step)
        if self._writer is None:
            self._writer = pa.ipc.new_stream(pa.PythonFile(self._sink, mode="w"), batch.schema)
        self._writer.write_batch(batch, custom_metadata=meta)
        return list(self._sink.drain())

    def close(self) -> list[bytes | memoryview]:
        """The stream's end-of-stream marker."""
        if self._writer is None:
            return []
        self._writer.close()
        return list(self._sink.drain())


def encode_steps(dataset: Dataset, planner: Planner, dp_rank: int, steps: Iterable[int]) -> Iterator[bytes | memoryview]:
    """Arrow IPC stream bytes for ``steps`` of ``dp_rank``, produced lazily, step by step."""
    encoder = StepEncoder(dataset, planner, dp_rank)
    for step in steps:
        yield from encoder.step(step)
    yield from encoder.close()


class WholeBody(Response):
    """A body of known length sent as its parts, as they are: no join, no chunked encoding."""

    def __init__(self, parts: list[bytes | memoryview], media_type: str, headers: dict[str, str]) -> None:
        self.parts = parts
        self.nbytes = sum(len(p) for p in parts)
        super().__init__(content=b"", media_type=media_type, headers=headers)
        self.headers["content-length"] = str(self.nbytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        for i, part in enumerate(self.parts):
            await send({"type": "http.response.body", "body": part, "more_body": i < len(self.parts) - 1})
        if not self.parts:
            await send({"type": "http.response.body", "body": b""})
