"""A whole node lost and a link cut under a 3-node x 2-worker DDP job (gloo, CPU): every role
restores the same step from the surviving copies, wherever it lands, and the run ends bitwise-equal
to one without failures. Runs in network namespaces when root (CI is), and on loopback with the
slow tests (``-m slow``): the same scenario, a frozen daemon standing in for the cut link."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ffplane_harness.local_cluster import LocalCluster
from tests._servers import until
from tests.conftest import cluster_in, create_job
from tests.trainer_client._ddp_cluster import DdpRun, losses

STEPS = 24


@pytest.fixture(params=[pytest.param("loopback", marks=pytest.mark.slow), "netns"])
def cluster(request: pytest.FixtureRequest, tmp_path: Path, data_dir: Path) -> Iterator[LocalCluster]:
    with cluster_in(request.param, tmp_path, data_dir, nodes=5) as c:  # the data server, three nodes, one replacement
        yield c


def _status(c: LocalCluster, job: str) -> dict[str, Any]:
    assert c.dataserver is not None
    return httpx.get(f"{c.dataserver.url}/v1/jobs/{job}/status").json()


def _cut(c: LocalCluster, node: int) -> None:
    if c.net is not None:
        c.net.cut(c.net.nodes[node + 1])
    else:  # loopback cannot drop packets: a frozen daemon is silent the same way
        os.kill(c.daemons[node].pid, signal.SIGSTOP)


def _heal(c: LocalCluster, node: int) -> None:
    if c.net is not None:
        c.net.heal(c.net.nodes[node + 1])
    else:
        os.kill(c.daemons[node].pid, signal.SIGCONT)


def test_node_loss_and_cut_link_end_bitwise_equal(cluster: LocalCluster, tmp_path: Path) -> None:
    ds = cluster.start_dataserver()
    for _ in range(3):
        cluster.start_daemon(budget_mb=256)
    until(lambda: len(_status(cluster, "lost")["ring"]) == 3)
    for name in ("straight", "lost"):
        create_job(ds, name=name, dp=6, batch_per_rank=4, max_steps=STEPS)
        (tmp_path / name).mkdir()
    runs: list[DdpRun] = []
    try:
        runs.append(DdpRun(cluster, tmp_path / "straight", "straight", [0, 0, 1, 1, 2, 2], STEPS))
        runs[-1].wait()

        out = tmp_path / "lost"
        run = DdpRun(cluster, out, "lost", [0, 0, 1, 1, 2, 2], STEPS)
        runs.append(run)
        run.wait_progress(7)
        run.kill(run.on(1))  # node 1 goes: its workers, its daemon, its shared memory
        cluster.lose_node(1)
        run.kill()  # the others fail in their next collective; torchrun restarts them
        until(lambda: "n1" in _status(cluster, "lost")["dead"], what="n1 declared dead")
        cluster.start_daemon(index=3, budget_mb=256)  # the replacement node joins
        until(lambda: "n3" in _status(cluster, "lost")["ring"])
        # roles do not stay on nodes: ranks 0-1 now run on the new node, 2-3 (whose node died) on n0
        run = DdpRun(cluster, out, "lost", [3, 3, 0, 0, 2, 2], STEPS)
        runs.append(run)
        run.wait_progress(15)

        _cut(cluster, 2)  # node 2's link goes down: its daemon falls silent, its ranks hang
        until(lambda: "n2" in _status(cluster, "lost")["dead"], what="the cut node declared dead")
        run.kill()
        _heal(cluster, 2)
        until(lambda: "n2" in _status(cluster, "lost")["ring"], what="the healed node back in the ring")
        run = DdpRun(cluster, out, "lost", [3, 3, 0, 0, 2, 2], STEPS)
        runs.append(run)
        run.wait()
    finally:
        for r in runs:
            r.kill()

    straight = tmp_path / "straight"
    for rank in range(6):
        assert (out / f"final-{rank}.txt").read_text() == (straight / f"final-{rank}.txt").read_text()
        assert losses(out, rank) == losses(straight, rank)  # every step's loss, bit for bit
        assert sorted(losses(out, rank)) == list(range(STEPS))
    restores = [line for r in range(6) for line in (out / f"worker-{r}.log").read_text().splitlines() if "restored step" in line]
    assert len(restores) == 12 and all(line.endswith("from memory") for line in restores)  # two restarts x six ranks
