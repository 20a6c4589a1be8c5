"""A daemon whose index is damaged or gone starts anyway and keeps every verifiable shard."""

from __future__ import annotations

import json
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch

from tests._servers import Proc
from trainer_client import Checkpointer, Layout

ROLE = "dp0-pp0-tp0"


def _state(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(128, 64, generator=g) + step, "step": step}


def _saved_then_killed(start_daemon: Callable[..., Proc], shm_root: Path) -> list[tuple[str, int, str]]:
    """Steps 1..5 saved by two roles, the daemon SIGKILLed; the versions it held."""
    daemon = start_daemon()
    cks = [Checkpointer("job", Layout(dp=2, dp_rank=r), socket_path=shm_root / "daemon.sock") for r in range(2)]
    for step in range(1, 6):
        for ck in cks:
            ck.save(step, _state(step))
    for ck in cks:
        ck.close()
    held = _versions(daemon)
    daemon.kill(signal.SIGKILL)
    return held


def _versions(daemon: Proc) -> list[tuple[str, int, str]]:
    roles = httpx.get(daemon.url + "/v1/state").json()["roles"]
    return sorted((r["role"], v["step"], v["checksum"]) for r in roles for v in r["versions"])


def _slot_files(shm_root: Path) -> list[Path]:
    return sorted(shm_root.glob("job/state/*/slot-*.bin"))


@pytest.mark.parametrize("damage", ["garbled", "deleted"])
def test_a_damaged_or_missing_index_is_rebuilt_from_the_slots(damage: str, start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    held = _saved_then_killed(start_daemon, shm_root)
    slots = _slot_files(shm_root)
    data = shm_root / "_index" / "data.mdb"
    if damage == "garbled":  # before: lmdb.InvalidError, rc 1
        data.write_bytes(b"\x5a" * data.stat().st_size)
    else:  # before: the daemon forgot its slots and left them orphaned
        shutil.rmtree(shm_root / "_index")

    daemon = start_daemon()
    assert _versions(daemon) == held and len(held) == 6  # every committed version, checksums and all
    assert daemon.log().count("rebuilt it from the slot and replica files") == 1
    got = Checkpointer("job", Layout(dp=2, dp_rank=1), socket_path=shm_root / "daemon.sock").restore()
    assert got is not None and got.step == 5 and torch.equal(got.state["w"], _state(5)["w"])  # type: ignore[arg-type]

    ck = Checkpointer("job", Layout(dp=2, dp_rank=0), socket_path=shm_root / "daemon.sock")
    ck.save(6, _state(6))
    ck.close()
    assert _slot_files(shm_root) == slots  # the same slots reused, none orphaned


def test_a_slot_that_fails_its_checksum_is_not_adopted(start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    held = _saved_then_killed(start_daemon, shm_root)
    newest = next(v for v in held if v[0] == ROLE and v[1] == 5)
    meta = next(
        json.loads(p.read_text()) for p in shm_root.glob(f"job/state/{ROLE}/slot-*.bin.meta") if json.loads(p.read_text())["step"] == 5
    )
    with open(shm_root / meta["path"], "r+b") as f:
        f.write(b"\xff" * 64)
    shutil.rmtree(shm_root / "_index")

    daemon = start_daemon()
    assert _versions(daemon) == [v for v in held if v != newest]
    # the two roles agree on the newest step both still have
    got = Checkpointer("job", Layout(dp=2, dp_rank=1), socket_path=shm_root / "daemon.sock").restore()
    assert got is not None and got.step == 4


def test_a_replica_that_cannot_be_verified_is_quarantined(tmp_path: Path, data_dir: Path) -> None:
    from ffplane_harness.local_cluster import LocalCluster
    from tests._servers import TOKEN, until

    with LocalCluster(tmp_path, data_dir, TOKEN) as c:
        c.start_dataserver()
        for _ in range(2):
            c.start_daemon(budget_mb=64)
        assert c.dataserver is not None
        until(lambda: len(httpx.get(f"{c.dataserver.url}/v1/nodes").json()["ring"]) == 2)  # type: ignore[union-attr]
        ck = Checkpointer("job", socket_path=c.socket(0))
        for step in range(1, 4):
            ck.save(step, _state(step))
        ck.close()
        until(
            lambda: sorted(r["step"] for r in httpx.get(c.daemons[1].url + "/v1/state").json()["replicas"]) == [2, 3],
            what="steps 2 and 3 replicated on n1",
        )
        c.daemons[1].kill(signal.SIGKILL)
        root = c.roots[1]
        # by name: the glob also finds the role's spare (step 1's retired file), which sorts last
        with open(root / f"job/replica/{ROLE}/{3:012d}.bin", "r+b") as f:  # step 3's bytes damaged
            f.write(b"\xff" * 16)
        shutil.rmtree(root / "_index")
        c.start_daemon(budget_mb=64, index=1)
        rebuilt = [json.loads(line) for line in c.daemons[-1].log().splitlines() if "rebuilt it from" in line]
        assert len(rebuilt) == 1 and rebuilt[0]["replicas"] == 1  # step 2 adopted, step 3 not
        assert rebuilt[0]["quarantined"] == [f"job/replica/{ROLE}/{3:012d}.bin"]
        assert list(root.glob(f"_quarantine/*/job/replica/{ROLE}/{3:012d}.bin"))
