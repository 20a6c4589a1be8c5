"""The many-nodes test cluster: the same scenario in network namespaces and on plain loopback."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ffplane_harness.local_cluster import LocalCluster
from ffplane_harness.netns import Netns, available, leftovers
from tests._servers import TOKEN
from tests.conftest import cluster_in, create_job

NETNS_WHY = available()


@pytest.fixture(params=["loopback", "netns"])
def cluster(request: pytest.FixtureRequest, tmp_path: Path, data_dir: Path) -> Iterator[LocalCluster]:
    with cluster_in(request.param, tmp_path, data_dir, nodes=3) as c:
        yield c


def _read_on_node(c: LocalCluster, node: int, dp_rank: int, out: Path) -> subprocess.CompletedProcess[str]:
    assert c.dataserver is not None
    env = {**os.environ, "FFPLANE_DATASERVER": c.dataserver.url, "FFPLANE_TOKEN": TOKEN, "FFPLANE_DAEMON_SOCKET": str(c.socket(node))}
    argv = c.worker_argv(node, [sys.executable, "-m", "tests.trainer_client._reader_worker", "j1", str(dp_rank), str(out)])
    return subprocess.run(argv, env=env, cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=120)


def test_each_node_reads_its_dp_rank_through_its_own_daemon(cluster: LocalCluster, tmp_path: Path) -> None:
    ds = cluster.start_dataserver()
    cluster.start_daemon()
    cluster.start_daemon()
    create_job(ds, max_steps=12)
    for node in range(2):
        out = tmp_path / f"node{node}"
        out.mkdir()
        r = _read_on_node(cluster, node, node, out)
        assert r.returncode == 0, r.stderr[-2000:]
        lines = (out / "steps.txt").read_text().split("\n")[:-1]
        assert [int(line.split()[0]) for line in lines] == list(range(12))
        assert {line.split()[2] for line in lines} == {"daemon"}  # from the node's cache, not direct


def test_a_cut_link_isolates_the_node_until_healed(tmp_path: Path) -> None:
    if NETNS_WHY:
        pytest.skip(NETNS_WHY)
    probe = "import socket,sys; socket.create_connection((sys.argv[1], 9), timeout=1)"
    with Netns(2, rate="100mbit") as net:
        a, b = net.nodes

        def reach() -> str:
            r = subprocess.run(b.exec_argv([sys.executable, "-c", probe, a.addr]), capture_output=True, text=True)
            return "refused" if "ConnectionRefused" in r.stderr else "timeout" if "timed out" in r.stderr else r.stderr[-200:]

        before = net.tx_bytes(b)
        assert reach() == "refused"  # a's kernel answered: the link works (nothing listens on 9)
        assert net.tx_bytes(b) > before  # the interface counters see the traffic
        net.cut(a)
        assert reach() == "timeout"
        net.heal(a)
        assert reach() == "refused"
        tag = net.tag
    assert not [n for n in leftovers() if n.startswith(tag)]
