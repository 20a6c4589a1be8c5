"""The interface every dataset format implements: a name, a length, a schema, and ``take``.

The formats (``_arrow_dataset``, ``_lmdb_dataset``) implement it; the catalog
(:mod:`dataserver.catalog`) recognises a folder's format and opens it.
"""

from __future__ import annotations

import abc

import numpy as np
import pyarrow as pa

from ffplane_contract.errors import CorruptError


class DatasetError(CorruptError):
    """A dataset is missing, malformed or cannot be read; the message says which and why (a
    CorruptError: its files do not parse as the format says)."""


class Dataset(abc.ABC):
    """A random-access table of samples."""

    name: str
    num_samples: int
    schema: pa.Schema

    @abc.abstractmethod
    def take(self, indices: np.ndarray) -> pa.RecordBatch:
        """Rows ``indices`` (int64, any order, each in ``[0, num_samples)``), in that order."""

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "format": type(self).__name__,
            "num_samples": self.num_samples,
            "columns": {f.name: str(f.type) for f in self.schema},
        }

    def close(self) -> None:  # noqa: B027 - a format without handles has nothing to release
        """Release file handles and mappings."""
