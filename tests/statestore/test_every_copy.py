"""A restore tries every copy of a step (local slot, replica, durable) before an older step."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch

from ffplane_harness.local_cluster import LocalCluster
from tests._servers import Proc, until
from tests.statestore.conftest import daemon_state, start_ring
from trainer_client import Checkpointer, Layout

ROLE = "dp0-pp0-tp0"


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(200, 129, generator=g) + step, "step": step}


def _known(c: LocalCluster, node: int, step: int) -> bool:
    """Whether the coordinator has heard that node ``node`` holds ROLE's step ``step``."""
    assert c.dataserver is not None
    locations = httpx.get(f"{c.dataserver.url}/v1/jobs/job/status").json()["shard_locations"]
    return f"n{node}" in locations.get(ROLE, {}).get(str(step), [])


def _held_on(c: LocalCluster, node: int, step: int) -> dict[str, Any] | None:
    """The replica of ROLE at ``step`` that node ``node`` holds."""
    return next((r for r in daemon_state(c, node)["replicas"] if r["role"] == ROLE and r["step"] == step and r["kind"] == "replica"), None)


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(b"\xff" * 16)


def _save(c: LocalCluster, node: int, steps: range) -> None:
    ck = Checkpointer("job", Layout(), socket_path=c.socket(node))
    for step in steps:
        ck.save(step, _state(step))
    ck.close()


def test_a_corrupt_newest_slot_is_restored_from_the_replica_of_the_same_step(cluster: LocalCluster) -> None:
    start_ring(cluster, 2)  # n0 → n1 → n0
    _save(cluster, 0, range(1, 4))
    until(lambda: _held_on(cluster, 1, 3) and _known(cluster, 1, 3), what="step 3 replicated to n1, and the coordinator told")
    slot = next(v for v in daemon_state(cluster, 0)["roles"][0]["versions"] if v["step"] == 3)
    _flip(cluster.roots[0] / slot["slot"], slot["nbytes"] // 2)

    got = Checkpointer("job", Layout(), socket_path=cluster.socket(0)).restore()
    # before: step 2 (the older local version), although n1's copy of step 3 was intact
    assert got is not None and got.step == 3 and torch.equal(got.state["w"], _state(3)["w"])
    after = daemon_state(cluster, 0)
    assert 3 not in [v["step"] for v in after["roles"][0]["versions"]]  # the corrupt copy is gone
    assert after["pulled_bytes"] > 0


def test_a_corrupt_copy_on_a_peer_gives_way_to_the_older_intact_step_it_holds(cluster: LocalCluster) -> None:
    start_ring(cluster, 2)
    _save(cluster, 0, range(1, 4))
    until(lambda: _known(cluster, 1, 3) and _known(cluster, 1, 2), what="steps 2 and 3 replicated to n1, and the coordinator told")
    replica = _held_on(cluster, 1, 3)
    assert replica is not None
    _flip(cluster.roots[1] / "job" / "replica" / ROLE / f"{3:012d}.bin", replica["nbytes"] // 3)
    cluster.lose_node(0)
    assert cluster.dataserver is not None
    until(lambda: "n0" in httpx.get(f"{cluster.dataserver.url}/v1/jobs/job/status").json()["dead"], what="n0 declared dead")  # type: ignore[union-attr]

    cluster.start_daemon("--gate-chunk-kb", "64", index=2, budget_mb=64)  # a replacement node
    # before: every ask pulled step 3 from n1, failed its checksum, and answered 503 until the timeout
    got = Checkpointer("job", Layout(), socket_path=cluster.socket(2), timeout_s=20).restore()
    assert got is not None and got.step == 2 and torch.equal(got.state["w"], _state(2)["w"])


def test_the_durable_copy_of_the_newest_step_comes_before_an_older_step_in_memory(
    tmp_path: Path, start_daemon: Callable[..., Proc], shm_root: Path
) -> None:
    daemon = start_daemon("--durable-dir", str(tmp_path / "durable"), "--durable-every", "1")
    ck = Checkpointer("job", socket_path=shm_root / "daemon.sock")
    for step in range(1, 4):
        ck.save(step, _state(step))
    ck.close()
    until(lambda: httpx.get(daemon.url + "/v1/state").json()["durable_written"] == 3, what="three durable copies")
    newest = httpx.get(daemon.url + "/v1/state").json()["roles"][0]["versions"][0]
    assert newest["step"] == 3
    _flip(shm_root / newest["slot"], 0)

    got = Checkpointer("job", socket_path=shm_root / "daemon.sock").restore()
    # before: step 2 from memory
    assert got is not None and got.step == 3 and got.source == "durable" and torch.equal(got.state["w"], _state(3)["w"])


def test_a_header_changed_at_rest_is_a_corrupt_copy_and_the_replica_is_restored(cluster: LocalCluster) -> None:
    """One digit of step 3's tree changed in node 0's index (same length, LMDB still valid): the
    restarted daemon finds the header does not match its digest and drops that copy; the restore
    takes step 3 from node 1's replica, with the tree as it was saved."""
    import json

    import lmdb

    start_ring(cluster, 2)
    _save(cluster, 0, range(1, 4))
    until(lambda: _held_on(cluster, 1, 3) and _known(cluster, 1, 3), what="step 3 replicated to n1, and the coordinator told")
    cluster.daemons[0].kill()
    env = lmdb.open(str(cluster.roots[0] / "_index"), max_dbs=0)
    with env.begin(write=True) as txn:
        keys = [k for k, _ in txn.cursor() if k.startswith(b"state/job/") and k.endswith(b"3")]
        assert keys, "step 3's index record"
        key = keys[-1]
        raw = txn.get(key)
        tree = json.loads(raw)["header"]["tree_json"]
        assert tree.count("3") == 1, tree  # the step counter: the one 3 in the tree
        record = json.loads(raw)
        damaged = json.dumps(record | {"header": {**record["header"], "tree_json": tree.replace("3", "7")}}).encode()
        assert len(damaged) == len(raw)
        txn.put(key, damaged)
    env.close()
    cluster.start_daemon("--gate-chunk-kb", "64", budget_mb=64, index=0)
    until(lambda: _known(cluster, 0, 2), what="node 0 back, its intact steps told")
    got = Checkpointer("job", Layout(), socket_path=cluster.socket(0)).restore()
    # before: step 3 with state["step"] == 7, restored as intact, n1's copy never used
    assert got is not None and got.step == 3 and got.state["step"] == 3 and torch.equal(got.state["w"], _state(3)["w"])
    assert "does not match its digest" in cluster.daemons[-1].log()


def test_a_dcp_load_whose_local_copy_is_corrupt_reads_the_replica_of_the_same_step(cluster: LocalCluster) -> None:
    import torch.distributed.checkpoint as dcp

    from trainer_client.dcp import DaemonReader, DaemonWriter

    start_ring(cluster, 2)
    writer = DaemonWriter("job", socket_path=cluster.socket(0))
    for step in (1, 2, 3):
        dcp.save({"w": _state(step)["w"]}, storage_writer=writer, checkpoint_id=step, no_dist=True)
    writer.wait()
    writer.close()
    until(lambda: _held_on(cluster, 1, 3) and _known(cluster, 1, 3), what="step 3 replicated to n1, and the coordinator told")
    slot = next(v for v in daemon_state(cluster, 0)["roles"][0]["versions"] if v["step"] == 3)
    _flip(cluster.roots[0] / slot["slot"], slot["nbytes"] // 2)

    target = {"w": torch.zeros(200, 129)}
    reader = DaemonReader("job", socket_path=cluster.socket(0))
    # before: CheckpointException "a copy of step 3 ... failed its checksum and was dropped; load again"
    dcp.load(target, storage_reader=reader, no_dist=True)
    reader.close()
    assert reader.step == 3 and torch.equal(target["w"], _state(3)["w"])
    assert 3 not in [v["step"] for v in daemon_state(cluster, 0)["roles"][0]["versions"]]  # the corrupt copy is gone
