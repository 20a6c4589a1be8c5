"""ffplane client library for training code: DataLoader and the state API (Checkpointer)."""

from trainer_client.batches import Batch
from trainer_client.checkpointer import Checkpointer, Restored
from trainer_client.dataloader import DataLoader
from trainer_client.razor import Layout
from trainer_client.state_codec import StateError
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
        "Checkpointer",
        "Layout",
        "Restored",
        "StateError",
        "CorruptError",
        "DataLoader",
        "FFPlaneError",
        "FFTimeoutError",
        "NotFoundError",
        "TransportError",
        "UnauthorisedError",
    ]
)
