"""Every checkpointing system bench/peers.py compares, behind one small interface.

A :class:`Peer` lives in one rank process (``bench/_peers/job.py``) and uses its system only
through that system's public API. ``SYSTEMS`` maps a name to the module and class that implement
it; a peer whose package is not installed raises :class:`Unavailable` from its constructor with
the reason, which becomes the row's note.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class Unavailable(Exception):
    """This system cannot run here; the message says why (the import error, the missing piece)."""


@dataclass
class Ctx:
    """What a rank knows: its place, a node-local work folder and the orchestrator's settings."""

    rank: int
    world: int
    work: Path  # this system's folder on this rank's node (tmpfs)
    job: str
    config: dict[str, Any] = field(default_factory=dict)
    replicated_state: bool = False  # every rank holds the same state (DDP)


class Peer:
    """One system's save/restore path, as a training loop calls it."""

    api = "local"  # "local": plain tensors; "dcp": the DCP state dict (DTensors as FSDP2 shards them)
    replicates = False  # keeps a copy on another node by itself

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx

    def before_step(self) -> None:
        """Called before a training step's collectives (ffplane settles its last save there,
        as its DDP comm hook does)."""

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Checkpoint ``state`` as step ``step``; returns when the training loop may go on."""
        raise NotImplementedError

    def wait(self) -> None:
        """Until the last save is complete in this system's own tier."""

    def replicated(self, step: int) -> bool:
        """Whether a copy of ``step`` exists on another node now."""
        return False

    def restore(self, into: dict[str, Any]) -> int | None:
        """The newest step this system can restore, loaded into ``into``'s tensors; None: none."""
        raise NotImplementedError

    def newest_file(self) -> Path | None:
        """The largest data file of the newest local copy (one of its bytes gets flipped)."""
        return None

    def held_paths(self) -> list[Path]:
        """Files and folders in tmpfs/shm this rank's saves keep (their allocated bytes count)."""
        return [self.ctx.work]

    def close(self) -> None:
        pass


class NoSave(Peer):
    """Saves nothing: the step time and CPU of the loop itself, the floor every row is read against."""

    def save(self, step: int, state: dict[str, Any]) -> None:
        pass

    def restore(self, into: dict[str, Any]) -> int | None:
        return None

    def held_paths(self) -> list[Path]:
        return []


SYSTEMS: dict[str, tuple[str, str]] = {
    "none": ("bench._peers", "NoSave"),
    "ffplane": ("bench._peers.builtin", "FFPlane"),
    "ffplane_dcp": ("bench._peers.builtin", "FFPlaneDCP"),
    "ffplane_dcp_full": ("bench._peers.builtin", "FFPlaneDCPFull"),
    "torch_save_shm": ("bench._peers.builtin", "TorchSave"),
    "dcp_fs_shm": ("bench._peers.builtin", "DCPFileSystem"),
    "dcp_async": ("bench._peers.builtin", "DCPAsync"),
    "dlrover": ("bench._peers.dlrover", "DLRover"),
    "nvrx": ("bench._peers.nvrx", "NVRx"),
    "mlflashpoint": ("bench._peers.mlflashpoint", "MLFlashpoint"),
}


def peer(name: str, ctx: Ctx) -> Peer:
    module, cls = SYSTEMS[name]
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise Unavailable(f"import failed: {exc}") from None
    return getattr(mod, cls)(ctx)
