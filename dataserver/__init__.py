"""ffplane data server: dataset catalog, deterministic planner, batch streaming over HTTP."""

from dataserver.catalog import Catalog, Dataset, DatasetError, open_dataset
from dataserver.config import ServeConfig
from dataserver.ingest import IngestConfig, IngestError, ingest
from dataserver.planner import Generation, Planner, StepPlan

__all__ = sorted(
    [
        "Catalog",
        "Dataset",
        "DatasetError",
        "Generation",
        "IngestConfig",
        "IngestError",
        "Planner",
        "ServeConfig",
        "StepPlan",
        "ingest",
        "open_dataset",
    ]
)
