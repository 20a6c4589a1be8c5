"""The ffplane Arrow dataset: ``manifest.json`` plus memory-mapped Arrow IPC file shards."""

from __future__ import annotations

import json
import threading
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa

from dataserver._row_gather import RowGather
from dataserver.dataset import Dataset, DatasetError
from ffplane_runtime.pagemap import populate_read

MANIFEST_NAME = "manifest.json"
FORMAT = "ffplane.arrow/1"
POPULATE_LIMIT = 8 << 30  # datasets up to this size get their page tables populated at open


def fixed_width_view(column: pa.Array) -> np.ndarray | None:
    """A zero-copy 2-D (rows, width) numpy view of a fixed-width column, or None."""
    if column.null_count:
        return None
    t = column.type
    if pa.types.is_fixed_size_list(t) and _is_numeric(t.value_type):
        values = column.values
        if values.null_count:
            return None
        width = t.list_size
        flat = values.to_numpy(zero_copy_only=True)
        start = column.offset * width
        return flat[start : start + len(column) * width].reshape(len(column), width)
    if _is_numeric(t):
        return column.to_numpy(zero_copy_only=True).reshape(len(column), 1)
    return None


def _fixed_array(field: pa.Field, rows: np.ndarray) -> pa.Array:
    """A (rows, width) array as the field's Arrow type, without a copy."""
    flat = pa.array(rows.reshape(-1))
    if pa.types.is_fixed_size_list(field.type):
        return pa.FixedSizeListArray.from_arrays(flat, field.type.list_size)
    return flat


def _is_numeric(t: pa.DataType) -> bool:
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t))


def file_crc32(path: Path, block: int = 1 << 24) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(block):
            crc = zlib.crc32(chunk, crc)
    return crc


class ArrowDataset(Dataset):
    """Rows addressed across all record batches of all shards, in manifest order."""

    def __init__(self, root: Path, name: str, populate_limit: int = POPULATE_LIMIT) -> None:
        self.name = name
        self.root = root
        try:
            manifest = json.loads((root / MANIFEST_NAME).read_text())
        except (OSError, ValueError) as exc:
            raise DatasetError(f"{root / MANIFEST_NAME}: unreadable manifest: {exc}") from exc
        if manifest.get("format") != FORMAT:
            raise DatasetError(f"{root / MANIFEST_NAME}: format {manifest.get('format')!r}, expected {FORMAT!r}")
        self.manifest = manifest
        self._chunks: list[pa.RecordBatch] = []
        views: list[dict[str, np.ndarray]] = []  # per chunk: fixed-width columns as (rows, width)
        self._maps: list[pa.MemoryMappedFile] = []
        schema: pa.Schema | None = None
        for shard in manifest["shards"]:
            path = root / shard["path"]
            try:
                mm = pa.memory_map(str(path), "r")
                reader = pa.ipc.open_file(mm)
            except (OSError, pa.ArrowInvalid) as exc:
                raise DatasetError(f"{path}: cannot open shard: {exc}") from exc
            self._maps.append(mm)
            if schema is None:
                schema = reader.schema
            elif not reader.schema.equals(schema):
                raise DatasetError(f"{path}: schema differs from the first shard's")
            for i in range(reader.num_record_batches):
                chunk = reader.get_batch(i)
                self._chunks.append(chunk)
                views.append({f.name: v for f, col in zip(chunk.schema, chunk.columns) if (v := fixed_width_view(col)) is not None})
        if schema is None:
            raise DatasetError(f"{root}: the manifest lists no shards")
        self.schema = schema
        self._gathers = {f.name: RowGather([v[f.name] for v in views]) for f in schema if all(f.name in v for v in views)}
        total = sum(int(s["bytes"]) for s in manifest["shards"])
        if total <= populate_limit:
            # Page-table population of a dataset that fits in memory, once, in the background,
            # instead of a minor fault per page in the serving path.
            regions = []
            for mm in self._maps:
                mm.seek(0)
                whole = mm.read_buffer(mm.size())  # zero-copy view of the whole mapping
                regions.append((whole.address, whole.size))
            threading.Thread(target=self._populate, args=(regions,), name=f"populate {name}", daemon=True).start()
        self._offsets = np.cumsum([0] + [len(c) for c in self._chunks]).astype(np.int64)
        self.num_samples = int(self._offsets[-1])
        if self.num_samples != manifest["num_samples"]:
            raise DatasetError(f"{root}: shards hold {self.num_samples} rows, manifest says {manifest['num_samples']}")

    def _populate(self, regions: list[tuple[int, int]]) -> None:
        for address, size in regions:
            populate_read(address, size)

    def verify(self) -> None:
        """Re-read every shard and compare its CRC-32 with the manifest's."""
        for shard in self.manifest["shards"]:
            got = file_crc32(self.root / shard["path"])
            if got != shard["crc32"]:
                raise DatasetError(f"{self.root / shard['path']}: checksum {got:#x} != manifest's")

    def take(self, indices: np.ndarray) -> pa.RecordBatch:
        idx = np.asarray(indices, dtype=np.int64)
        chunk_of = np.searchsorted(self._offsets, idx, side="right") - 1
        local = idx - self._offsets[chunk_of]
        groups: list[tuple[int, np.ndarray]] | None = None
        arrays = []
        for col_i, field in enumerate(self.schema):
            gather = self._gathers.get(field.name)
            if gather is not None:
                arrays.append(_fixed_array(field, gather.take(chunk_of, local)))
                continue
            if groups is None:
                groups = [(int(c), np.nonzero(chunk_of == c)[0]) for c in np.unique(chunk_of)]
            arrays.append(self._gather_generic(col_i, idx, groups))
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)

    def _gather_generic(self, col_i: int, idx: np.ndarray, groups: list[tuple[int, np.ndarray]]) -> pa.Array:
        parts = [self._chunks[c].column(col_i).take(pa.array(idx[rows] - self._offsets[c])) for c, rows in groups]
        if len(parts) == 1:
            return parts[0]
        order = np.concatenate([rows for _, rows in groups])
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        return pa.concat_arrays(parts).take(pa.array(inverse))

    def close(self) -> None:
        self._chunks.clear()
        self._gathers.clear()
        for mm in self._maps:
            mm.close()
        self._maps.clear()
