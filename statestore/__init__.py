"""ffplane node daemon: shared-memory data cache, state slots, durable tier, ops HTTP API."""

from statestore.config import DaemonConfig
from statestore.daemon import Daemon, create_app
from statestore.shm import ShmError
from statestore.slots import SlotError

__all__ = sorted(["DaemonConfig", "Daemon", "ShmError", "SlotError", "create_app"])
