"""Parity replicas (``--parity-k``): a group's shards XORed on the node after it, a lost node's
shard rebuilt there from the group's other shards — with real daemons on loopback and a real
node loss (daemon SIGKILLed, its shared memory wiped)."""

from __future__ import annotations

import signal
from typing import Any

import httpx
import pytest
import torch

from ffplane_harness.local_cluster import LocalCluster
from tests._servers import TOKEN, until
from tests.statestore.conftest import daemon_state, start_ring
from trainer_client import Checkpointer, Layout
from trainer_client.checkpointer import settle_all


def _state(step: int, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return {"w": torch.randn(256, 129 + rank, generator=g), "step": step}  # a size of its own per rank


def _shared(step: int, rank: int) -> dict[str, Any]:
    """Replicated over the ranks (DDP's), razored: every rank saves a slice, and a restore
    gathers every rank's — a lost one's rebuilt while the others are pulled for it too."""
    return {"w": torch.randn(300, 257, generator=torch.Generator().manual_seed(step)), "step": step}


def _ranks(c: LocalCluster, nodes: list[int], world: int, razored: bool = False) -> list[Checkpointer]:
    private = () if razored else ("w", "step")
    return [Checkpointer("job", Layout(dp=world, dp_rank=r), socket_path=c.socket(n), private_keys=private) for r, n in enumerate(nodes)]


def _save(ranks: list[Checkpointer], steps: range, state: Any = _state) -> None:
    for step in steps:
        settle_all()
        for r, ck in enumerate(ranks):
            ck.save(step, state(step, r))
    settle_all()


def _role(rank: int, world: int) -> str:
    return Layout(dp=world, dp_rank=rank).role


@pytest.mark.parametrize("k, nodes", [(2, 3), (4, 5)], ids=["k2", "k4"])
def test_a_lost_node_is_rebuilt_from_its_groups_parity_bitwise(cluster: LocalCluster, k: int, nodes: int) -> None:
    start_ring(cluster, nodes, "--parity-k", str(k))
    for i in range(nodes):
        cluster.until_successor(i, f"n{(i + 1) % nodes}")
    ranks = _ranks(cluster, list(range(nodes)), nodes)
    _save(ranks, range(1, 4))
    # the node after the first group holds its parity (a member whose first view had fewer nodes
    # sent its first saves elsewhere, and sends its newest again once its view has them all)
    holder = until(lambda: (d := daemon_state(cluster, k))["parity"]["roles"] == k and d, what="every member's parity on the holder")
    _save(ranks, range(4, 6))  # two more saves: what a view with fewer nodes made elsewhere is gone
    for ck in ranks:
        ck.close()
    holder = daemon_state(cluster, k)
    assert holder["parity_k"] == k and holder["parity"]["accumulators"] == 2 and holder["parity"]["roles"] == k  # steps 2, 3
    shards = [len(_state(5, r)["w"].view(-1)) * 4 for r in range(k)]
    assert holder["parity"]["bytes"] == 2 * max(shards) + 2 * 0  # two versions, each the largest member's size
    (role,) = daemon_state(cluster, 0)["roles"]
    assert role["slots"] == 2 and "rebuilt from its parity group of" in role["memory"]["survives"]
    cluster.lose_node(1)  # a member of the first group
    assert cluster.dataserver is not None
    url = cluster.dataserver.url
    until(lambda: "n1" in httpx.get(f"{url}/v1/jobs/job/status").json()["dead"], what="n1 declared dead")
    cluster.start_daemon("--gate-chunk-kb", "64", "--parity-k", str(k), index=nodes, budget_mb=64)
    restored = _ranks(cluster, [0, nodes, *range(2, nodes)], nodes)  # rank 1 on the replacement node
    for r, ck in enumerate(restored):
        got = ck.restore()
        ck.close()
        assert got is not None and got.step == 5, (r, got and got.step)
        assert torch.equal(got.state["w"], _state(5, r)["w"])
    assert "shard rebuilt from parity" in cluster.daemons[k].log()


def test_razored_state_restored_by_every_rank_at_once_after_a_loss_rebuilds_once_bitwise(cluster: LocalCluster) -> None:
    """Every rank restores at the same time and each gathers every rank's slice: the holder
    rebuilds the lost one while restores pull the group's other slices it needs too (in
    bench/memory.py they met in one transfer, and one was refused mid-way: a rebuild now pulls
    through the same shared pulls a restore uses)."""
    from concurrent.futures import ThreadPoolExecutor

    start_ring(cluster, 4, "--parity-k", "2")
    for i in range(4):
        cluster.until_successor(i, f"n{(i + 1) % 4}")
    ranks = _ranks(cluster, [0, 1, 2, 3], 4, razored=True)
    _save(ranks, range(1, 4), _shared)
    for ck in ranks:
        ck.close()
    until(lambda: (d := daemon_state(cluster, 2))["parity"]["roles"] == 2 and d, what="n0's and n1's parity on n2")
    cluster.lose_node(1)
    assert cluster.dataserver is not None
    url = cluster.dataserver.url
    until(lambda: "n1" in httpx.get(f"{url}/v1/jobs/job/status").json()["dead"], what="n1 declared dead")
    cluster.start_daemon("--gate-chunk-kb", "64", "--parity-k", "2", index=4, budget_mb=64)
    restored = _ranks(cluster, [0, 4, 2, 3], 4, razored=True)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda ck: ck.restore(agree=False), restored))
    for ck in restored:
        ck.close()
    assert [g.step if g is not None else None for g in got] == [3, 3, 3, 3]
    assert all(torch.equal(g.state["w"], _shared(3, 0)["w"]) for g in got if g is not None)


def test_a_parity_holder_restarted_keeps_what_it_holds_and_rebuilds_from_it(cluster: LocalCluster) -> None:
    start_ring(cluster, 3, "--parity-k", "2")
    for i in range(3):
        cluster.until_successor(i, f"n{(i + 1) % 3}")
    ranks = _ranks(cluster, [0, 1, 2], 3)
    _save(ranks, range(1, 3))
    for ck in ranks:
        ck.close()
    before = daemon_state(cluster, 2)["parity"]
    cluster.daemons[2].kill(signal.SIGKILL)
    again = cluster.start_daemon("--gate-chunk-kb", "64", "--parity-k", "2", index=2, budget_mb=64)
    assert httpx.get(again.url + "/v1/state").json()["parity"]["accumulators"] == before["accumulators"] == 2
    cluster.lose_node(0)
    assert cluster.dataserver is not None
    url = cluster.dataserver.url
    until(lambda: "n0" in httpx.get(f"{url}/v1/jobs/job/status").json()["dead"], what="n0 declared dead")
    cluster.start_daemon("--gate-chunk-kb", "64", "--parity-k", "2", index=3, budget_mb=64)
    ck = _ranks(cluster, [3], 3)[0]
    got = ck.restore()
    ck.close()
    assert got is not None and got.step == 2 and torch.equal(got.state["w"], _state(2, 0)["w"])


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _push(url: str, role: str, step: int, data: bytes, source: str, checksum: str | None = None) -> httpx.Response:
    import xxhash

    meta = {
        "nbytes": len(data),
        "checksum": checksum or xxhash.xxh3_64_hexdigest(data),
        "header": {"layout_roles": [role]},
        "source": source,
    }
    begin = httpx.post(f"{url}/v1/replicas/job/{role}/{step}/begin", json=meta, headers=AUTH)
    assert begin.status_code == 200, begin.text
    put = httpx.put(f"{url}/v1/replicas/job/{role}/{step}", params={"offset": 0}, content=data, headers=AUTH)
    if put.status_code != 200:
        return put
    return httpx.post(f"{url}/v1/replicas/job/{role}/{step}/commit", headers=AUTH)


def test_what_a_parity_holder_is_sent_wrong_changes_nothing_it_held(cluster: LocalCluster) -> None:
    """Pushes to a parity holder from outside: bytes that do not match their checksum (their XOR
    is in: the accumulator is dropped with it, never kept holding it), a body that runs past its
    size (refused before a byte is XORed), a finish before every byte, a token-less push — each
    refused with a 4xx and a sentence."""
    start_ring(cluster, 3, "--parity-k", "2")
    holder = cluster.daemons[2].url
    a, b = bytes(range(256)) * 64, bytes(reversed(range(256))) * 64
    assert _push(holder, "dp0-pp0-tp0", 1, a, "n0").status_code == 200
    bad = _push(holder, "dp1-pp0-tp0", 1, b, "n1", checksum="0" * 16)
    assert bad.status_code == 422 and "corrupt" in bad.text  # its XOR is in: the accumulator goes with it
    assert httpx.get(holder + "/v1/state").json()["parity"]["accumulators"] == 0
    assert _push(holder, "dp0-pp0-tp0", 2, a, "n0").status_code == 200
    over = httpx.post(
        f"{holder}/v1/replicas/job/dp1-pp0-tp0/2/begin",
        json={"nbytes": 16, "checksum": "x", "header": {"layout_roles": ["dp1-pp0-tp0"]}, "source": "n1"},
        headers=AUTH,
    )
    assert over.status_code == 200
    past = httpx.put(f"{holder}/v1/replicas/job/dp1-pp0-tp0/2", params={"offset": 0}, content=b"y" * 32, headers=AUTH)
    assert 400 <= past.status_code < 500 and "past" in past.text
    early = httpx.post(f"{holder}/v1/replicas/job/dp1-pp0-tp0/2/commit", headers=AUTH)
    assert early.status_code == 409 and "received" in early.text
    nobody = httpx.post(f"{holder}/v1/replicas/job/dp1-pp0-tp0/2/begin", json={"nbytes": 1, "checksum": "x", "header": {}, "source": "n1"})
    assert nobody.status_code == 401
    state = httpx.get(holder + "/v1/state").json()["parity"]
    assert state["accumulators"] == 1 and state["roles"] == 2  # step 2: a's bytes, b's half-done push
