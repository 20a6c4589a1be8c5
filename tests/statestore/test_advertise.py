"""A daemon advertises an address its peers can reach, never loopback or 0.0.0.0 across hosts."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from ffplane_harness.local_cluster import LocalCluster
from tests._servers import TOKEN, Proc, refused_daemon, start, until
from tests.conftest import cluster_in
from trainer_client import Checkpointer


def _members(ds: Proc) -> dict[str, str]:
    return {n: m["address"] for n, m in httpx.get(ds.url + "/v1/nodes").json()["members"].items()}


def test_a_daemon_listening_everywhere_advertises_the_address_that_reaches_the_data_server(
    tmp_path: Path, dataserver: Proc, shm_root: Path
) -> None:
    args = [
        "serve",
        "--dataserver",
        dataserver.url,
        "--root",
        str(shm_root),
        "--host",
        "0.0.0.0",
        "--port",
        "0",
        "--budget-mb",
        "64",
        "--node-id",
        "a",
    ]
    daemon = start("statestore", args, tmp_path, "daemon")
    try:
        port = daemon.ready["port"]
        # before: "http://0.0.0.0:<port>", which sends a peer's pushes to the peer itself
        until(lambda: _members(dataserver).get("a") == f"http://127.0.0.1:{port}", what="a registered at 127.0.0.1")
    finally:
        daemon.kill()


@pytest.mark.parametrize("address", ["0.0.0.0", "::"])
def test_an_unreachable_advertise_address_is_refused(shm_root: Path, address: str) -> None:
    r = refused_daemon(shm_root, "--advertise-address", address)
    assert r.returncode == 2 and "cannot be reached by other hosts" in r.stderr
    assert list(shm_root.iterdir()) == []


@pytest.fixture
def hosts(tmp_path: Path, data_dir: Path) -> Iterator[LocalCluster]:
    with cluster_in("netns", tmp_path, data_dir, nodes=3) as c:  # the data server's host and two more
        c.start_dataserver()
        yield c


def test_two_hosts_started_without_an_address_replicate_to_each_other_and_survive_a_node_loss(hosts: LocalCluster) -> None:
    assert hosts.net is not None and hosts.dataserver is not None
    for _ in range(2):
        hosts.start_daemon("--host", "0.0.0.0")  # as the shipped manifests start it: listening everywhere
    addrs = [n.addr for n in hosts.net.nodes[1:]]
    until(
        lambda: (
            sorted(_members(hosts.dataserver).values()) == sorted(f"http://{a}:{d.ready['port']}" for a, d in zip(addrs, hosts.daemons))
        ),
        what="each daemon at its host's address",
    )  # type: ignore[arg-type]
    ck = Checkpointer("job", socket_path=hosts.socket(0))
    for step in range(1, 4):
        ck.save(step, {"w": torch.full((64, 64), float(step))})
    ck.close()
    status = lambda: httpx.get(f"{hosts.dataserver.url}/v1/jobs/job/status").json()  # type: ignore[union-attr]
    until(lambda: "n1" in status()["shard_locations"].get("dp0-pp0-tp0", {}).get("3", []), what="step 3 replicated to the other host")
    hosts.lose_node(0)
    until(lambda: "n0" in status()["dead"], what="n0 declared dead")
    got = Checkpointer("job", socket_path=hosts.socket(1)).restore()
    # before: both advertised 0.0.0.0, n0's "replicas" stayed on n0, and this was None: a silent fresh start
    assert got is not None and got.step == 3 and torch.equal(got.state["w"], torch.full((64, 64), 3.0))


def test_listening_on_loopback_while_the_data_server_is_on_another_host_is_refused(hosts: LocalCluster, tmp_path: Path) -> None:
    assert hosts.net is not None and hosts.dataserver is not None
    node = hosts.net.nodes[1]
    root = Path("/dev/shm") / f"ffplane-test-adv-{node.addr}"
    cmd = node.exec_argv(
        [sys.executable, "-m", "statestore", "serve", "--dataserver", hosts.dataserver.url, "--root", str(root), "--host", "127.0.0.1"]
    )
    try:
        r = subprocess.run(
            cmd, capture_output=True, text=True, timeout=60, check=False, env={"FFPLANE_TOKEN": TOKEN, "PATH": "/usr/bin:/bin"}
        )
        assert r.returncode == 2 and f"pass --host {node.addr}" in r.stderr, r.stderr
        assert not root.exists()
    finally:
        shutil.rmtree(root, ignore_errors=True)  # a daemon that started anyway must not leave it behind


def test_a_job_whose_every_copy_is_gone_raises_instead_of_starting_fresh(tmp_path: Path, data_dir: Path) -> None:
    from trainer_client import NotFoundError

    with cluster_in("loopback", tmp_path, data_dir, nodes=2) as c:
        ds = c.start_dataserver()
        for _ in range(2):
            c.start_daemon(budget_mb=64)
        until(lambda: len(httpx.get(ds.url + "/v1/nodes").json()["ring"]) == 2)
        ck = Checkpointer("job", socket_path=c.socket(0))
        for step in range(1, 4):
            ck.save(step, {"w": torch.full((8,), float(step))})
        ck.close()
        until(lambda: "n1" in httpx.get(ds.url + "/v1/jobs/job/status").json()["shard_locations"].get("dp0-pp0-tp0", {}).get("3", []))
        c.lose_node(0)
        c.lose_node(1)
        until(lambda: {"n0", "n1"} <= set(httpx.get(ds.url + "/v1/jobs/job/status").json()["dead"]), what="both nodes dead")
        c.start_daemon(budget_mb=64)
        # before: None, and the job started again from step 0 without a word
        with pytest.raises(NotFoundError, match="committed step 3"):
            Checkpointer("job", socket_path=c.socket(2)).restore()
