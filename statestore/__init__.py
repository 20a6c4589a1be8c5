"""ffplane node daemon: shared-memory data cache (and, later, state slots), ops HTTP API."""

from statestore.config import DaemonConfig
from statestore.daemon import Daemon, create_app
from statestore.shm import ShmError

__all__ = sorted(["DaemonConfig", "Daemon", "ShmError", "create_app"])
