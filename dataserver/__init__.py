"""ffplane data server: dataset catalog, deterministic planner, batch streaming over HTTP.

The names below load on first use, so that importing ``dataserver.protocol`` (every ffplane
process does) costs no pyarrow or LMDB.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dataserver.catalog import Catalog, Dataset, DatasetError, open_dataset
    from dataserver.config import ServeConfig
    from dataserver.ingest import IngestConfig, IngestError
    from dataserver.planner import Generation, Planner, StepPlan

_HOME = {
    "Catalog": "catalog",
    "Dataset": "catalog",
    "DatasetError": "catalog",
    "Generation": "planner",
    "IngestConfig": "ingest",
    "IngestError": "ingest",
    "Planner": "planner",
    "ServeConfig": "config",
    "StepPlan": "planner",
    "open_dataset": "catalog",
}  # ingest(): from dataserver.ingest (a package attribute would be the module)
__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'dataserver' has no attribute {name!r}")
    return getattr(importlib.import_module(f"dataserver.{_HOME[name]}"), name)
