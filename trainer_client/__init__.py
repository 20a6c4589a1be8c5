"""ffplane client library for training code: DataLoader and the state API (Checkpointer).

The names below are imported on first use, not with the package: ``python -m
trainer_client.warm_start`` (a worker's stand-in) must start without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ffplane_contract.errors import (
        CapacityError,
        ConflictError,
        CorruptError,
        FFPlaneError,
        FFTimeoutError,
        InvalidError,
        NotFoundError,
        TransportError,
        UnauthorisedError,
        UnavailableError,
    )
    from trainer_client.batches import Batch
    from trainer_client.checkpointer import Checkpointer, Restored, settle_all
    from trainer_client.dataloader import DataLoader
    from trainer_client.link_hints import LinkHints
    from trainer_client.razor import Layout
    from trainer_client.rng import RngState
    from trainer_client.state_codec import StateError

_HOME = {
    "Batch": "trainer_client.batches",
    "CapacityError": "ffplane_contract.errors",
    "Checkpointer": "trainer_client.checkpointer",
    "CorruptError": "ffplane_contract.errors",
    "ConflictError": "ffplane_contract.errors",
    "DataLoader": "trainer_client.dataloader",
    "FFPlaneError": "ffplane_contract.errors",
    "FFTimeoutError": "ffplane_contract.errors",
    "InvalidError": "ffplane_contract.errors",
    "Layout": "trainer_client.razor",
    "LinkHints": "trainer_client.link_hints",
    "NotFoundError": "ffplane_contract.errors",
    "Restored": "trainer_client.checkpointer",
    "RngState": "trainer_client.rng",
    "StateError": "trainer_client.state_codec",
    "TransportError": "ffplane_contract.errors",
    "UnauthorisedError": "ffplane_contract.errors",
    "UnavailableError": "ffplane_contract.errors",
    "settle_all": "trainer_client.checkpointer",
}
__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'trainer_client' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    if not any(n in globals() for n in _HOME):
        from trainer_client.events import emit

        emit("imported")  # the timeline's: torch and ffplane loaded (a record only for an attached handler)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])
