"""ffplane client library for training code: DataLoader (and, later, the state API)."""

from trainer_client.batches import Batch
from trainer_client.dataloader import DataLoader
from trainer_client.errors import (
    CorruptError,
    FFPlaneError,
    FFTimeoutError,
    NotFoundError,
    TransportError,
    UnauthorisedError,
)

__all__ = sorted(
    [
        "Batch",
        "CorruptError",
        "DataLoader",
        "FFPlaneError",
        "FFTimeoutError",
        "NotFoundError",
        "TransportError",
        "UnauthorisedError",
    ]
)
