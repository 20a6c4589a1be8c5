"""ffplane node daemon: shared-memory data cache, state slots, durable tier, ops HTTP API."""

from __future__ import annotations

from statestore.app import create_app
from statestore.config import DaemonConfig
from statestore.daemon import Daemon
from statestore.shm import ShmError

__all__ = ["Daemon", "DaemonConfig", "ShmError", "create_app"]
