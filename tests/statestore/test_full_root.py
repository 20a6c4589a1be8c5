"""A node's tmpfs filled by something else while a job saves: the save is refused with a
CapacityError naming the root, nothing is left behind, the slot is free again, and the newest step
is the same before and after the daemon restarts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ffplane_contract.errors import CapacityError
from ffplane_harness.local_cluster import LocalCluster
from tests.statestore.conftest import daemon_state, fill, small_tmpfs
from trainer_client import Checkpointer


def _newest(c: LocalCluster) -> int | None:
    roles = daemon_state(c, -1)["roles"]
    return max((v["step"] for r in roles for v in r["versions"]), default=None)


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != "filler")


def test_a_full_tmpfs_refuses_the_save_with_a_capacity_error_and_leaves_nothing(cluster: LocalCluster) -> None:
    """Before: a raw "OSError 28" (500), then SlotBusyError for every later save, a temporary
    file left, and step 3 newest while running but step 4 after a restart (the index had recorded
    the commit before the sidecar write failed)."""
    with small_tmpfs(cluster, 0) as root:
        cluster.start_daemon("--gate-chunk-kb", "64", budget_mb=40)
        ck = Checkpointer("job", socket_path=cluster.socket(0))
        try:
            for step in range(4):  # every slot written once: same-size saves reuse their files
                ck.save(step, {"w": torch.full((1 << 20,), float(step))})
            ck.wait()
            files = _files(root)
            filler = fill(root)
            for step in (4, 5):  # the second must not find its slot taken by the first
                with pytest.raises(CapacityError) as err:
                    ck.save(step, {"w": torch.full((1 << 20,), float(step))})
                    ck.wait()
                assert str(root) in str(err.value) and "no room for" in str(err.value), err.value
            assert _newest(cluster) == 3 and _files(root) == files  # nothing recorded, nothing left
            filler.unlink()
            ck.save(6, {"w": torch.full((1 << 20,), 6.0)})  # room again: the job goes on
            ck.wait()
            assert _newest(cluster) == 6
            fill(root)
            with pytest.raises(CapacityError):
                ck.save(7, {"w": torch.full((1 << 20,), 7.0)})
                ck.wait()
        finally:
            ck.close()
        cluster.daemons[0].kill()
        (root / "filler").unlink()
        cluster.start_daemon("--gate-chunk-kb", "64", budget_mb=40, index=0)
        assert _newest(cluster) == 6  # the same newest step after a restart
        got = Checkpointer("job", socket_path=cluster.socket(0)).restore()
        assert got is not None and got.step == 6 and torch.equal(got.state["w"], torch.full((1 << 20,), 6.0))
