from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests._servers import Proc
from trainer_client import Checkpointer


def test_a_save_of_many_tensors_sets_off_no_collection_while_it_builds(start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    """The encode, the header's static part and the slot views of 3,000 tensors are built with the
    collector held off (trainer_client._collector): built with it on, they set off dozens."""
    start_daemon()
    state = {f"t{i}": torch.full((4,), float(i)) for i in range(3000)}
    ckpt = Checkpointer("many", socket_path=shm_root / "daemon.sock")
    collections: list[int] = []

    def count(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    try:
        ckpt.save(0, state)  # slots allocated and mapped
        ckpt.wait()
        gc.callbacks.append(count)
        try:
            ckpt.save(1, state)
        finally:
            gc.callbacks.remove(count)
        ckpt.wait()
        # the young collections after the encode's pause and after the save's own (each found
        # what the block before it made); the 4 MiB of pairs and header no more
        assert len(collections) <= 3, collections
        assert gc.isenabled()
        restored = ckpt.restore()
        assert restored is not None and restored.step == 1 and torch.equal(restored.state["t2999"], state["t2999"])
    finally:
        ckpt.close()
