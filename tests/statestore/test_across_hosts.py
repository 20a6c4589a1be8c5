"""Daemons as the Kubernetes DaemonSet runs them — each node its own address, listening on
0.0.0.0 and advertising the node's address — in network namespaces: replication, a restore on
another node and a node loss all go through those addresses."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import torch

from tests._servers import until
from tests.conftest import cluster_in
from trainer_client import Checkpointer, Layout


def _state(step: int) -> dict[str, object]:
    """Replicated state (the same on both dp ranks): each rank saves half, a restore needs both."""
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64 << 10, generator=g) + step, "step": step}


def test_daemons_bound_to_every_interface_replicate_restore_anywhere_and_survive_a_node_loss(tmp_path: Path, data_dir: Path) -> None:
    with cluster_in("netns", tmp_path, data_dir, nodes=4, bind_all=True) as c:
        assert c.net is not None
        ds = c.start_dataserver()
        for _ in range(3):
            c.start_daemon("--gate-chunk-kb", "64", budget_mb=64)

        def three() -> dict[str, Any] | None:
            nodes: dict[str, Any] = httpx.get(ds.url + "/v1/nodes").json()
            return nodes if len(nodes["ring"]) == 3 else None

        nodes = until(three, what="three daemons in the ring")
        advertised = {n: urlsplit(m["address"]).hostname for n, m in nodes["members"].items()}
        assert advertised == {f"n{i}": c.net.nodes[i + 1].addr for i in range(3)}  # never 0.0.0.0 or loopback
        assert all(d.ready["host"] == "0.0.0.0" for d in c.daemons)

        def successor(d: int) -> str | None:
            succ: str | None = httpx.get(c.daemons[d].url + "/v1/state").json()["replication"]["successor"]
            return succ

        # the coordinator's ring reaches each daemon with its next heartbeat answer; a commit made
        # before then has no successor to wait for (the ring pushes it later)
        for d in (0, 1):
            until(lambda: successor(d), what=f"n{d} knows its ring successor")

        cks = [Checkpointer("hosts", Layout(dp=2, dp_rank=r), socket_path=c.socket(r)) for r in range(2)]  # roles on n0 and n1
        for step in (1, 2, 3):
            for ck in cks:
                ck.save(step, _state(step))
        for ck in cks:
            ck.settle()
            ck.close()
        succ = successor(0)  # url: the advertised address
        assert succ is not None
        held = httpx.get(c.daemons[int(succ[1:])].url + "/v1/state").json()["replicas"]
        assert any(r["role"] == "dp0-pp0-tp0" and r["step"] == 3 for r in held)  # pushed to n0's successor at its address

        # the coordinator learns of step 3 from the daemons' next heartbeats
        until(lambda: httpx.get(ds.url + "/v1/jobs/hosts/status").json()["restorable_step"] == 3, what="step 3 restorable job-wide")
        elsewhere = Checkpointer("hosts", Layout(dp=2, dp_rank=0), socket_path=c.socket(2)).restore()  # a role restored on n2
        assert elsewhere is not None and elsewhere.step == 3 and torch.equal(elsewhere.state["w"], _state(3)["w"])

        c.lose_node(0)
        until(
            lambda: (
                "n0" in httpx.get(ds.url + "/v1/nodes").json()["members"]
                and not httpx.get(ds.url + "/v1/nodes").json()["members"]["n0"]["alive"]
            )
        )
        after = Checkpointer("hosts", Layout(dp=2, dp_rank=0), socket_path=c.socket(2)).restore()  # from the replica
        assert after is not None and after.step == 3 and torch.equal(after.state["w"], _state(3)["w"])
