"""Datasets the server can plan over and read from: a name, a length, a schema, and ``take``.

Two served forms, both opened read-only and memory-mapped:

* an ffplane Arrow dataset — a directory holding ``manifest.json`` and Arrow IPC file shards,
  as written by ``dataserver ingest`` (see :mod:`dataserver.ingest`);
* an LMDB environment (a directory holding ``data.mdb``), key scheme in :mod:`dataserver._lmdb_dataset`.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa

from dataserver._arrow_dataset import MANIFEST_NAME, ArrowDataset
from dataserver._lmdb_dataset import LmdbDataset
from dataserver.dataset import Dataset, DatasetError
from ffplane_contract.errors import NotFoundError
from ffplane_contract.limits import is_name  # dataset (folder) names the server serves

SAMPLE_INDEX_COLUMN = "_sample_index"


def open_dataset(path: str | os.PathLike[str], name: str | None = None) -> Dataset:
    """Open the dataset stored at ``path``, recognising its form from its files."""
    p = Path(path)
    name = name or p.name
    if (p / MANIFEST_NAME).is_file():
        return ArrowDataset(p, name)
    if (p / "data.mdb").is_file():
        return LmdbDataset(p, name)
    raise DatasetError(
        f"{p} is not a dataset: expected {MANIFEST_NAME} (run `dataserver ingest ... --out {p}`) or an LMDB environment (data.mdb)"
    )


class Catalog:
    """Every dataset under one directory, by folder name; opened on first use."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise DatasetError(f"dataset directory {self.root} does not exist")
        self._open: dict[str, Dataset] = {}
        self._sample_bytes: dict[str, int] = {}

    def names(self) -> list[str]:
        return sorted(d.name for d in self.root.iterdir() if d.is_dir() and not d.name.startswith("."))

    def known_sample_bytes(self, name: str) -> int | None:
        """``sample_bytes(name)`` if measured already (never blocks), else None."""
        return self._sample_bytes.get(name)

    def sample_bytes(self, name: str) -> int:
        """An estimate of one served sample's bytes in ``name``: the dataset's files over its
        samples, plus the ``_sample_index`` column. Served batches are uncompressed Arrow, as the
        files are, so this sizes a step's body without encoding it (an average: a step of
        variable-length samples may come out larger)."""
        found = self._sample_bytes.get(name)
        if found is None:
            ds = self.get(name)
            total = 0
            for dirpath, _dirs, files in os.walk(self.root / name):
                for f in files:
                    try:
                        st = os.stat(os.path.join(dirpath, f))
                    except OSError:
                        continue
                    total += min(st.st_size, st.st_blocks * 512)  # an LMDB file may be sparse
            found = -(-total // max(1, ds.num_samples)) + 8
            self._sample_bytes[name] = found
        return found

    def opened(self, name: str) -> Dataset | None:
        """``name`` if it is open already (never blocks), else None."""
        return self._open.get(name)

    def get(self, name: str) -> Dataset:
        """The dataset ``name``, opened; NotFoundError if there is none, DatasetError if it
        cannot be opened."""
        ds = self._open.get(name)
        if ds is None:
            if not is_name(name) or not (self.root / name).is_dir():
                raise NotFoundError(f"unknown dataset {name[:140]!r}; known: {self.names()}")
            try:
                ds = open_dataset(self.root / name, name)
            except OSError as exc:  # what a format did not put in its own words
                raise DatasetError(str(exc)) from exc
            self._open[name] = ds
        return ds

    def describe(self, name: str) -> dict[str, object]:
        """``name``'s description, or ``{name, error}`` saying why it cannot be opened."""
        try:
            return self.get(name).describe()
        except NotFoundError:
            return {"name": name, "error": f"dataset {name!r} is not in the data directory any more"}
        except (DatasetError, OSError) as exc:
            return {"name": name, "error": str(exc)}

    def close(self) -> None:
        for ds in self._open.values():
            ds.close()
        self._open.clear()


def with_sample_index(batch: pa.RecordBatch, indices: np.ndarray) -> pa.RecordBatch:
    """Append the dataset index of every row, so consumers can audit exactly-once delivery."""
    return batch.append_column(SAMPLE_INDEX_COLUMN, pa.array(indices, pa.int64()))
