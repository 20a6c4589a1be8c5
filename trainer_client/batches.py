"""Arrow IPC bytes of one step → torch tensors, zero-copy where the bytes allow it.

A step's file is mapped ``MAP_PRIVATE``: tensors view the node cache's pages directly (no copy),
and an in-place op by training code gets private copy-on-write pages instead of corrupting the
shared cache. No ``MAP_POPULATE``: on a writable private mapping it write-faults (copies) every
page up front. ``MADV_POPULATE_READ`` instead maps the shared pages read-only in one call, off
the consumer's path when the DataLoader's look-ahead thread maps the next step (ctypes releases
the GIL for it; ``mmap.madvise`` does not). Tensors are built with
numpy over the writable mapping itself, not over Arrow's (immutable) buffers, so torch sees
ordinary writable memory.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from ffplane_runtime.pagemap import populate_read

Batch = dict[str, torch.Tensor | list[Any]]


class StepBytes:
    """Writable memory holding one step's Arrow IPC stream (a private file mapping or a bytearray)."""

    def __init__(self, memory: mmap.mmap | bytearray) -> None:
        self.memory = memory
        self.buffer = pa.py_buffer(memory)

    @classmethod
    def map(cls, path: Path) -> StepBytes:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            flags = mmap.MAP_PRIVATE
            mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        step = cls(mm)
        populate_read(step.buffer.address, size)
        return step

    def read(self) -> list[tuple[pa.RecordBatch, dict[str, str]]]:
        """Every record batch of the stream (one per step), zero-copy, with its custom metadata."""
        reader = pa.ipc.open_stream(pa.BufferReader(self.buffer))
        out: list[tuple[pa.RecordBatch, dict[str, str]]] = []
        while True:
            try:
                item = reader.read_next_batch_with_custom_metadata()
            except StopIteration:
                return out
            meta = {k.decode(): v.decode() for k, v in (item.custom_metadata or {}).items()}
            out.append((item.batch, meta))

    def view(self, buf: pa.Buffer, dtype: np.dtype, first: int, count: int) -> np.ndarray:
        """A writable numpy view of ``count`` items of ``buf`` from item ``first``."""
        offset = buf.address - self.buffer.address + first * dtype.itemsize
        if not 0 <= offset <= self.buffer.size:  # not inside our memory: copy rather than alias
            return np.frombuffer(buf, dtype=dtype, count=count, offset=first * dtype.itemsize).copy()
        return np.frombuffer(self.memory, dtype=dtype, count=count, offset=offset)

    def to_torch(self, batch: pa.RecordBatch) -> Batch:
        """One entry per column: a tensor for numeric columns, else a list."""
        return {name: self._column(col) for name, col in zip(batch.schema.names, batch.columns)}

    def _column(self, col: pa.Array) -> torch.Tensor | list[Any]:
        t = col.type
        if col.null_count == 0:
            if pa.types.is_fixed_size_list(t) and _numeric(t.value_type) and col.values.null_count == 0:
                width = t.list_size
                values = col.values
                dtype = np.dtype(t.value_type.to_pandas_dtype())
                flat = self.view(values.buffers()[1], dtype, values.offset + col.offset * width, len(col) * width)
                return torch.from_numpy(flat.reshape(len(col), width))
            if _numeric(t):
                dtype = np.dtype(t.to_pandas_dtype())
                return torch.from_numpy(self.view(col.buffers()[1], dtype, col.offset, len(col)))
            if pa.types.is_boolean(t):
                return torch.from_numpy(col.to_numpy(zero_copy_only=False))
            if pa.types.is_binary(t):
                # memoryviews into the step's bytes: decoders (PIL, numpy) read them without a copy
                offsets = np.frombuffer(col.buffers()[1], dtype=np.int32)[col.offset : col.offset + len(col) + 1]
                data = memoryview(col.buffers()[2])
                return [data[offsets[i] : offsets[i + 1]] for i in range(len(col))]
        return col.to_pylist()


def _numeric(t: pa.DataType) -> bool:
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t))
