"""ffplane node daemon: shared-memory data cache, state slots, durable tier, ops HTTP API.

The names below load on first use, so that a training process importing
``statestore.protocol`` loads no server code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from statestore.config import DaemonConfig
    from statestore.daemon import Daemon, create_app
    from statestore.shm import ShmError

_HOME = {"DaemonConfig": "config", "Daemon": "daemon", "ShmError": "shm", "create_app": "daemon"}
__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'statestore' has no attribute {name!r}")
    return getattr(importlib.import_module(f"statestore.{_HOME[name]}"), name)
