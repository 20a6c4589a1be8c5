"""RowGather: rows from many memory-mapped chunks, in the order asked, one copy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from dataserver._arrow_dataset import fixed_width_view
from dataserver._row_gather import RowGather


def _mapped_chunks(tmp_path: Path, sizes: list[int], width: int) -> tuple[list[np.ndarray], list[pa.MemoryMappedFile]]:
    """One Arrow IPC file per chunk (separate mappings, gaps between them), as shards are."""
    views, maps, first = [], [], 0
    for i, n in enumerate(sizes):
        values = np.arange(first * width, (first + n) * width, dtype=np.int32)
        col = pa.FixedSizeListArray.from_arrays(pa.array(values), width)
        path = tmp_path / f"chunk-{i}.arrow"
        with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, pa.schema([("tokens", col.type)])) as w:
            w.write_batch(pa.record_batch([col], names=["tokens"]))
        mm = pa.memory_map(str(path), "r")
        maps.append(mm)
        view = fixed_width_view(pa.ipc.open_file(mm).get_batch(0).column(0))
        assert view is not None
        views.append(view)
        first += n
    return views, maps


def test_rows_come_from_every_chunk_in_the_order_asked(tmp_path: Path) -> None:
    sizes, width = [5, 0, 7, 3], 6  # an empty chunk among them, as a short record batch can be
    views, maps = _mapped_chunks(tmp_path, sizes, width)
    whole = np.concatenate(views)
    offsets = np.cumsum([0, *sizes])
    rng = np.random.default_rng(0)
    idx = rng.permutation(whole.shape[0])
    chunk_of = np.searchsorted(offsets, idx, side="right") - 1
    got = RowGather(views).take(chunk_of, idx - offsets[chunk_of])
    assert got.dtype == np.int32 and got.shape == (len(idx), width)
    np.testing.assert_array_equal(got, whole[idx])
    got[0, 0] = -1  # a copy: the mapped shard is not written
    assert whole[idx[0], 0] != -1
    for mm in maps:
        mm.close()


def test_a_row_past_its_chunk_is_refused_not_read_from_the_next(tmp_path: Path) -> None:
    views, maps = _mapped_chunks(tmp_path, [4, 4], 3)
    gather = RowGather(views)
    with pytest.raises(IndexError):
        gather.take(np.array([0]), np.array([4]))  # would be chunk 1's first row, or a gap
    with pytest.raises(IndexError):
        gather.take(np.array([1]), np.array([-1]))
    for mm in maps:
        mm.close()
