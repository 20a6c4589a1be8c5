"""ffplane client library for training code: DataLoader and the state API (Checkpointer)."""

from trainer_client.batches import Batch
from trainer_client.checkpointer import Checkpointer, Restored
from trainer_client.dataloader import DataLoader
from trainer_client.errors import (
    CapacityError,
    CorruptError,
    FFPlaneError,
    FFTimeoutError,
    NotFoundError,
    TransportError,
    UnauthorisedError,
)
from trainer_client.link_hints import LinkHints
from trainer_client.razor import Layout
from trainer_client.state_codec import StateError

__all__ = sorted(
    [
        "Batch",
        "CapacityError",
        "Checkpointer",
        "Layout",
        "LinkHints",
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
