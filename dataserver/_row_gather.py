"""Rows of one fixed-width column, spread over many memory-mapped chunks, gathered in one copy.

A step's rows come from random places in every shard. Gathering chunk by chunk and then putting
the rows back in plan order copies every byte twice; ``np.take`` into a fresh buffer measured
slower still (2.9 ms per 4 MiB step against 0.6 for this; ``bench/data_path.py`` end to end).
Here every row is addressed by its byte offset from the lowest chunk's start, through one
numpy array whose items are whole rows (``void`` of the row's size) laid one *byte* apart over
the span of all chunks, so a single fancy index reads each row where it lies and writes the
step in plan order. Only the indexed rows are ever read: the span may hold unmapped gaps
between chunks, which nothing touches.
"""

from __future__ import annotations

import ctypes

import numpy as np


class RowGather:
    """``take(chunk_of, local)`` → rows ``local[i]`` of chunk ``chunk_of[i]``, as a (n, width) array."""

    def __init__(self, views: list[np.ndarray]) -> None:
        if not views or any(v.ndim != 2 or not v.flags.c_contiguous for v in views):
            raise ValueError("RowGather needs C-contiguous (rows, width) views, one per chunk")
        first = views[0]
        if any(v.dtype != first.dtype or v.shape[1] != first.shape[1] for v in views):
            raise ValueError("every chunk's view must have the same dtype and width")
        self.dtype = first.dtype
        self.width = first.shape[1]
        self.row_bytes = self.width * self.dtype.itemsize
        starts = [int(v.__array_interface__["data"][0]) for v in views]
        filled = [(s, v.nbytes) for s, v in zip(starts, views) if v.nbytes]  # an empty chunk's address means nothing
        self._base = min((s for s, _ in filled), default=0)
        span = max((s + n for s, n in filled), default=0) - self._base
        self._start = np.array([s - self._base if v.nbytes else 0 for s, v in zip(starts, views)], dtype=np.int64)
        self._rows = np.array([v.shape[0] for v in views], dtype=np.int64)
        row = np.dtype((np.void, self.row_bytes))
        self._any_row: np.ndarray
        if span:
            memory = np.frombuffer(memoryview((ctypes.c_char * span).from_address(self._base)), dtype=np.uint8)
            self._any_row = np.ndarray(shape=(span - self.row_bytes + 1,), dtype=row, buffer=memory, strides=(1,))
        else:
            self._any_row = np.empty(0, dtype=row)
        self._any_row.flags.writeable = False
        self._keep = views  # the mappings must outlive the raw view

    def take(self, chunk_of: np.ndarray, local: np.ndarray) -> np.ndarray:
        # Bounds are checked here because the raw view cannot: an index past a chunk's end
        # would read another chunk's bytes, or unmapped memory.
        if len(local) and (np.any(local < 0) or np.any(local >= self._rows[chunk_of])):
            raise IndexError("row index outside its chunk")
        offsets = self._start[chunk_of] + local * self.row_bytes
        return self._any_row[offsets].view(self.dtype).reshape(len(local), self.width)
