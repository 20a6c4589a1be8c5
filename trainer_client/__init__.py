"""ffplane client library for training code: DataLoader and the state API (Checkpointer).

The names below are imported on first use, not with the package: ``python -m
trainer_client.warm_start`` (a worker's stand-in) must start without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_HOME = {
    "Batch": "batches",
    "CapacityError": "errors",
    "Checkpointer": "checkpointer",
    "CorruptError": "errors",
    "DataLoader": "dataloader",
    "FFPlaneError": "errors",
    "FFTimeoutError": "errors",
    "Layout": "razor",
    "LinkHints": "link_hints",
    "NotFoundError": "errors",
    "Restored": "checkpointer",
    "StateError": "state_codec",
    "TransportError": "errors",
    "UnauthorisedError": "errors",
}
__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'trainer_client' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"trainer_client.{_HOME[name]}"), name)
    if not any(n in globals() for n in _HOME):
        from trainer_client.events import emit

        emit("imported")  # recovery timelines: torch and ffplane loaded (only with $FFPLANE_EVENTS_DIR)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])
