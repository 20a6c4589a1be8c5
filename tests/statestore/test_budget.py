"""The daemon's one budget ledger (``statestore.budget``), shared by the stores it is given to:
what one holds is room the others do not get."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ffplane_contract.errors import CapacityError
from statestore.budget import Budget
from statestore.index import Index
from statestore.replicas import ReplicaStore
from statestore.slots import SlotStore

MIB = 1 << 20


def test_slots_and_replicas_given_one_ledger_never_hold_more_than_it(shm_root: Path) -> None:
    index = Index(shm_root)
    budget = Budget(10 * MIB)
    slots, replicas = SlotStore(shm_root, index, budget), ReplicaStore(shm_root, index, budget)
    try:
        asyncio.run(slots.alloc("job", "dp0-pp0-tp0", MIB))  # 2 slots of 1 MiB (--versions 2)
        assert budget.describe() == {"slots_bytes": 2 * MIB, "replicas_bytes": 0, "free_bytes": 8 * MIB}
        replicas.begin("job", "dp1-pp0-tp0", 1, 7 * MIB, "c", {"layout_roles": ["dp1-pp0-tp0"]}, "n1")
        assert budget.free() == MIB
        with pytest.raises(CapacityError, match="1.0 MiB of the daemon's budget left"):  # fits 10 MiB alone, not beside the slots
            replicas.begin("job", "dp2-pp0-tp0", 1, 2 * MIB, "c", {"layout_roles": ["dp2-pp0-tp0"]}, "n1")
        with pytest.raises(CapacityError, match="needs 2 slots"):  # nor slots beside the replica
            asyncio.run(slots.alloc("job", "dp3-pp0-tp0", MIB))
    finally:
        replicas.close()
        slots.close()
        index.close()


def test_a_holder_is_counted_once() -> None:
    budget = Budget(MIB)
    budget.register("cache", lambda: 3)
    with pytest.raises(ValueError, match="already holds"):
        budget.register("cache", lambda: 0)
    assert budget.used() == 3 and budget.others("cache") == 0
