"""ffplane data server: dataset catalog, deterministic planner, batch streaming over HTTP."""

from __future__ import annotations

from dataserver.catalog import Catalog, open_dataset
from dataserver.config import ServeConfig
from dataserver.dataset import Dataset, DatasetError
from dataserver.ingest import IngestConfig, IngestError
from dataserver.planner import Generation, Planner, StepPlan

# ingest(): from dataserver.ingest (a package attribute would be the module)
__all__ = [
    "Catalog",
    "Dataset",
    "DatasetError",
    "Generation",
    "IngestConfig",
    "IngestError",
    "Planner",
    "ServeConfig",
    "StepPlan",
    "open_dataset",
]
