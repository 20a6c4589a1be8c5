from __future__ import annotations

import gc
import operator
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
        # the young collections after the pause, which find what the block made — here mostly
        # the copy list this slot keeps for its next save (3,000 views); 10 with the pauses taken
        # out of Checkpointer._save and encode
        assert len(collections) <= 6, collections
        assert gc.isenabled()
        restored = ckpt.restore()
        assert restored is not None and restored.step == 1 and torch.equal(restored.state["t2999"], state["t2999"])
    finally:
        ckpt.close()


def test_steady_saves_reuse_the_last_header_and_copy_list_and_a_replaced_tensor_is_still_saved(
    start_daemon: Callable[..., Proc], shm_root: Path
) -> None:
    """Saving the same tensors again reuses the last save's header entries and, per slot, its copy
    list (five objects per tensor per save outlived it: the young collections they set off, and
    their promotion to older ones, cost more than the save's own Python). A tensor replaced by
    another storage is copied from the new one, into every slot."""
    start_daemon()
    state = {f"t{i}": torch.full((4,), float(i)) for i in range(3000)}
    ckpt = Checkpointer("steady", socket_path=shm_root / "daemon.sock")
    try:
        for step in range(6):  # every slot saved into once: its copy list is there
            ckpt.save(step, state)
            ckpt.wait()
        slots = ckpt._commits._slots
        lists = {path: s.copies.pairs for path, s in slots.items() if s.copies is not None}
        entries = list(ckpt._encoded.tensors) if ckpt._encoded else []
        assert len(lists) == len(slots) == 2  # one role: its saves are settled
        for step in range(6, 10):
            ckpt.save(step, state)
            ckpt.wait()
        assert all(s.copies is not None and s.copies.pairs is lists[path] for path, s in slots.items())
        assert ckpt._encoded is not None and all(map(operator.is_, ckpt._encoded.tensors, entries))
        state["t7"] = torch.full((4,), -1.0)  # same size, another storage
        for step in range(10, 15):  # into every slot again
            state["t9"] += 1
            ckpt.save(step, state)
            ckpt.wait()
        assert not any(s.copies is not None and s.copies.pairs is lists[path] for path, s in slots.items())
        restored = ckpt.restore()
        assert restored is not None and restored.step == 14
        assert torch.equal(restored.state["t7"], state["t7"]) and torch.equal(restored.state["t9"], state["t9"])
    finally:
        ckpt.close()


def test_copy_lists_kept_by_slots_never_hold_an_earlier_saves_tensors(start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    """A state of new tensors every save (``{k: v.cpu()}`` from a GPU): a slot's kept copy list
    views its save's tensors, so kept in four slots it would hold four earlier states alive."""
    start_daemon()
    ckpt = Checkpointer("fresh", socket_path=shm_root / "daemon.sock")
    try:
        for step in range(8):
            ckpt.save(step, {"w": torch.full((1 << 16,), float(step))})
            ckpt.wait()
        kept = [s.copies for s in ckpt._commits._slots.values() if s.copies is not None]
        assert ckpt._encoded is not None and len(kept) == 1  # this save's list only: the others viewed older tensors
        assert kept[0].generation == ckpt._encoded.generation and kept[0].pairs[0][1] is ckpt._encoded.sources[0]
    finally:
        ckpt.close()
