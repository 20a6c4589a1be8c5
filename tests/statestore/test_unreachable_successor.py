"""A successor that keeps beating but takes no connection: reported, and the ring moves past it."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from bench import _faults
from ffplane_harness.local_cluster import LocalCluster
from tests._servers import TOKEN, until
from trainer_client import Checkpointer

ROLE = "job/dp0-pp0-tp0"


@pytest.fixture
def cluster(tmp_path: Path, data_dir: Path) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path, data_dir, TOKEN) as c:
        c.start_dataserver()
        for _ in range(3):  # n0 → n1 → n2 → n0
            c.start_daemon("--gate-chunk-kb", "64", "--replica-wait-s", "20", budget_mb=64)
        until(lambda: len(httpx.get(f"{c.dataserver.url}/v1/nodes").json()["ring"]) == 3, what="three daemons in the ring")  # type: ignore[union-attr]
        yield c


def _replication(c: LocalCluster, node: int) -> dict[str, Any]:
    return httpx.get(c.daemons[node].url + "/v1/state").json()["replication"]


def test_saves_go_on_replicated_past_a_successor_that_stops_answering(cluster: LocalCluster, caplog: pytest.LogCaptureFixture) -> None:
    ck = Checkpointer("job", socket_path=cluster.socket(0))
    state = {"w": torch.zeros(256, 256)}
    for step in range(1, 3):
        ck.save(step, state)
    ck.wait()
    until(lambda: _replication(cluster, 0)["roles"][ROLE] == {"committed": 2, "replicated": 2, "to": "n1"}, what="step 2 on n1")

    n1 = cluster.daemons[1]
    _faults.unreachable(n1.pid)  # every port it listens on: HTTP and bulk
    with caplog.at_level(logging.WARNING, logger="trainer_client.checkpointer"):
        for step in range(3, 7):
            state["w"].fill_(step)
            ck.save(step, state)
        ck.close()
    sent = _replication(cluster, 0)
    # before: each commit waited out --replica-wait-s (20 s here, 30 by default) for n1, in silence
    assert sent["commit_wait_timeouts"] == 0 and sent["roles"][ROLE] == {"committed": 6, "replicated": 6, "to": "n2"}
    nodes = httpx.get(f"{cluster.dataserver.url}/v1/nodes").json()  # type: ignore[union-attr]
    assert "n1" not in nodes["ring"] and nodes["members"]["n1"]["unreachable"] is True
    assert any("waits for the commit of step" in r.getMessage() and "--replica-wait-s" in r.getMessage() for r in caplog.records)

    # n1's own commits still go out, to n2: a node nobody reaches that is then lost keeps its state
    other = Checkpointer("job2", socket_path=cluster.socket(1))
    other.save(1, state)
    other.close()
    held = lambda: httpx.get(f"{cluster.dataserver.url}/v1/jobs/job2/status").json()["shard_locations"]  # type: ignore[union-attr]
    until(lambda: "n2" in held().get("dp0-pp0-tp0", {}).get("1", []), what="n1's commit replicated to n2 while n1 is out of the ring")

    _faults.heal(n1.pid, int(n1.ready["port"]))  # type: ignore[call-overload]
    until(lambda: "n1" in httpx.get(f"{cluster.dataserver.url}/v1/nodes").json()["ring"], what="n1 back in the ring once it answers")  # type: ignore[union-attr]
