"""Serving an LMDB environment directly.

Key scheme (documented in the README):

* sample ``i`` is stored under the 8-byte big-endian unsigned key ``i.to_bytes(8, "big")``, for
  ``i`` in ``[0, num_samples)``, its value the sample's bytes;
* an optional key ``b"__ffplane__"`` holds JSON ``{"num_samples": N, "column": "data",
  "dtype": "int32", "shape": [2048]}``. Without ``dtype`` each value is served as one ``binary``
  cell (e.g. an encoded image); with it, each value is a raw little-endian array of that dtype and
  shape, served as a fixed-size list (e.g. a row of token ids). Without the key, every other entry
  is a sample and ``num_samples`` is the entry count.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import lmdb
import numpy as np
import pyarrow as pa

from dataserver.dataset import Dataset, DatasetError

META_KEY = b"__ffplane__"


def sample_key(index: int) -> bytes:
    return int(index).to_bytes(8, "big")


class LmdbDataset(Dataset):
    def __init__(self, root: Path, name: str) -> None:
        self.name = name
        try:
            self._env = lmdb.open(str(root), readonly=True, lock=False, readahead=False, max_readers=512)
        except lmdb.Error as exc:
            raise DatasetError(f"{root}: cannot open LMDB environment: {exc}") from exc
        with self._env.begin() as txn:
            raw = txn.get(META_KEY)
            entries = int(self._env.stat()["entries"])
        meta: dict[str, object] = {}
        if raw is not None:
            try:
                meta = json.loads(raw)
            except ValueError as exc:
                raise DatasetError(f"{root}: key {META_KEY!r} is not JSON: {exc}") from exc
        self.num_samples = int(meta.get("num_samples", entries - (raw is not None)))  # type: ignore[call-overload]
        self.column = str(meta.get("column", "data"))
        self._dtype: np.dtype | None = None
        self._shape: tuple[int, ...] = ()
        if "dtype" in meta:
            self._dtype = np.dtype(str(meta["dtype"])).newbyteorder("<")
            self._shape = tuple(int(s) for s in meta.get("shape", []))  # type: ignore[attr-defined]
            value_type = pa.from_numpy_dtype(self._dtype)
            width = math.prod(self._shape)
            field_type = pa.list_(value_type, width) if self._shape else value_type
        else:
            field_type = pa.binary()
        self.schema = pa.schema([pa.field(self.column, field_type)])

    def take(self, indices: np.ndarray) -> pa.RecordBatch:
        with self._env.begin(buffers=False) as txn:
            values = []
            for i in np.asarray(indices, dtype=np.int64).tolist():
                v = txn.get(sample_key(i))
                if v is None:
                    raise DatasetError(f"{self.name}: no LMDB entry for sample {i} (key {sample_key(i).hex()})")
                values.append(v)
        if self._dtype is None:
            arr: pa.Array = pa.array(values, pa.binary())
        else:
            width = math.prod(self._shape) if self._shape else 1
            flat = np.frombuffer(b"".join(values), dtype=self._dtype)
            if flat.size != width * len(values):
                raise DatasetError(f"{self.name}: a value's size does not match dtype/shape {self._shape}")
            arr = pa.array(flat)
            if self._shape:
                arr = pa.FixedSizeListArray.from_arrays(arr, width)
        return pa.RecordBatch.from_arrays([arr], schema=self.schema)

    def close(self) -> None:
        self._env.close()
