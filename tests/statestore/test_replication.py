"""Neighbour replication and restore anywhere, with real daemons on loopback."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import torch

from ffplane_harness.local_cluster import LocalCluster
from tests._servers import TOKEN, Proc, until
from tests.statestore.conftest import daemon_state, start_ring
from trainer_client import Checkpointer, Layout

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _state(step: int, role: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(role)
    return {"w": torch.randn(300, 257, generator=g) + step, "step": step}  # ~300 KiB: several chunks


def _status(c: LocalCluster, job: str = "job") -> dict[str, Any]:
    assert c.dataserver is not None
    return httpx.get(f"{c.dataserver.url}/v1/jobs/{job}/status").json()


def _save(c: LocalCluster, node: int, role: int, steps: range, dp: int = 1) -> None:
    """Role ``role`` saves on node ``node``; with dp > 1 the ranks hold the same (replicated)
    state and each saves its razored slice."""
    ck = Checkpointer("job", Layout(dp=dp, dp_rank=role), socket_path=c.socket(node))
    for step in steps:
        ck.save(step, _state(step, role if dp == 1 else 0))
    ck.close()


def _held(c: LocalCluster, role: str, step: int) -> list[str]:
    return sorted(_status(c)["shard_locations"].get(role, {}).get(str(step), []))


def test_commits_reach_the_successor_verified_and_follow_a_node_loss(cluster: LocalCluster) -> None:
    start_ring(cluster, 3)  # ring n0 → n1 → n2 → n0
    _save(cluster, 0, 0, range(1, 4))
    role = "dp0-pp0-tp0"
    until(lambda: _held(cluster, role, 3) == _held(cluster, role, 2) == ["n0", "n1"], what="steps 2, 3 on the primary and the successor")
    primary = daemon_state(cluster, 0)["roles"][0]["versions"]
    newest_two = {(v["step"], v["checksum"]) for v in primary[:2]}
    # the newest two, same bytes (pushes may land in any order; a late older one may linger)
    until(lambda: newest_two <= {(r["step"], r.get("checksum")) for r in daemon_state(cluster, 1)["replicas"]}, what="the replicas on n1")
    sent = daemon_state(cluster, 0)["replication"]
    assert sent["roles"]["job/dp0-pp0-tp0"] == {"committed": 3, "replicated": 3, "to": "n1"}
    assert sent["pushes_in_one_request"] >= 2 and sent["pushes_resumed"] == 0  # no begin/commit round trips

    cluster.lose_node(0)
    until(lambda: "n0" in _status(cluster)["dead"], what="n0 declared dead")
    # the replica whose primary died is copied on to n1's successor: two copies again
    until(lambda: _held(cluster, role, 3) == ["n1", "n2"], what="re-replication to n2")

    cluster.start_daemon("--gate-chunk-kb", "64", index=3, budget_mb=64)  # a replacement node, empty
    got = Checkpointer("job", socket_path=cluster.socket(3)).restore()
    assert got is not None and got.step == 3 and torch.equal(got.state["w"], _state(3, 0)["w"])
    pulled = daemon_state(cluster, 3)
    assert pulled["pulled_bytes"] > 0 and {r["kind"] for r in pulled["replicas"]} == {"pulled"}


def test_replicas_resent_for_a_dead_primary_do_not_drop_the_newer_ones_its_successor_holds(cluster: LocalCluster) -> None:
    """n1 saves; its successor is n0, then n2 once it joins. When n1 dies, n0 sends on the older
    replicas it holds for n1 to its new successor n2 — which holds n1's newer ones. The resend used
    to carry n0's newest step of the role as if n0 were the primary, and n2 dropped its newer
    replicas as a future the primary had rewound from: restores went back several steps (19 in
    the spare benchmark), with no error. (It shows when n0's resend lands before n2's copies reach
    n0 and evict n0's older ones; that race went the bad way in 1 of 3 runs here.)"""
    start_ring(cluster, 2)  # n0 → n1 → n0
    role = "dp0-pp0-tp0"
    _save(cluster, 1, 0, range(1, 4))
    until(lambda: "n0" in _held(cluster, role, 3), what="steps 2, 3 replicated on n0")
    start_ring(cluster, 1)  # n0 → n1 → n2 → n0: n1's replicas now go to n2
    until(lambda: daemon_state(cluster, 1)["replication"]["successor"] == "n2", what="n1 replicating to n2")
    _save(cluster, 1, 0, range(4, 7))
    until(lambda: "n2" in _held(cluster, role, 6), what="steps 5, 6 replicated on n2")
    cluster.lose_node(1)
    until(lambda: "n1" in _status(cluster)["dead"], what="n1 declared dead")
    # two copies of the newest step again (n2 sends n1's replicas on to n0) — and n0's resend of
    # the older ones it held must not have cost n2 its copy (it did when the resend won the race)
    until(lambda: _held(cluster, role, 6) == ["n0", "n2"], what="two copies of step 6 after the resends")
    got = Checkpointer("job", socket_path=cluster.socket(2)).restore()
    assert got is not None and got.step == 6 and torch.equal(got.state["w"], _state(6, 0)["w"])


def test_a_node_that_no_longer_runs_a_role_does_not_make_its_successor_drop_that_roles_newer_replicas(cluster: LocalCluster) -> None:
    """After a spare takeover torchrun reshuffles ranks, so a role moves from one node to another
    and the first keeps its old versions as primary copies. At the next ring change it re-sent them
    claiming its newest step of the role as the role's newest, and its new successor dropped the
    newer replicas the role's new primary had pushed there as a rewound future: the next node loss
    went ~30 steps back (bench/recovery.py --spare). Here the role runs on n0, then on n1; n1 is
    lost; n2 must keep its replicas of steps 7 and 8."""
    start_ring(cluster, 3)  # n0 → n1 → n2 → n0
    role = "dp0-pp0-tp0"
    _save(cluster, 0, 0, range(1, 4))  # the role runs on n0
    until(lambda: "n1" in _held(cluster, role, 3), what="step 3 on n1")
    _save(cluster, 1, 0, range(4, 9))  # the role moved to n1
    until(lambda: "n2" in _held(cluster, role, 8), what="steps 7, 8 replicated on n2")
    cluster.lose_node(1)  # n0's successor becomes n2, which holds the role's newest replicas
    until(lambda: "n1" in _status(cluster)["dead"], what="n1 declared dead")

    def resent() -> bool:
        r = daemon_state(cluster, 0)["replication"]
        return bool(r["successor"] == "n2" and r["pending"] == 0)

    until(resent, what="n0 done re-sending to n2")
    until(lambda: "n2" in _held(cluster, role, 8) and "n0" in _held(cluster, role, 8), what="step 8 on n2, and forwarded to n0")
    held_on_n2 = sorted(r["step"] for r in daemon_state(cluster, 2)["replicas"] if r["role"] == role)
    assert 8 in held_on_n2 and 7 in held_on_n2, held_on_n2  # before: [2, 3] (n0's stale re-send dropped 7 and 8)
    got = Checkpointer("job", socket_path=cluster.socket(2)).restore()
    assert got is not None and got.step == 8 and torch.equal(got.state["w"], _state(8, 0)["w"])


def test_a_ring_change_elsewhere_resends_nothing_the_successor_holds(cluster: LocalCluster) -> None:
    """A node joining between others changes every daemon's ring; a predecessor whose successor
    stayed the same asks it before sending its newest versions again (it used to send each whole
    body only to hear "already here" — and a late ring view at start-up did the same)."""
    start_ring(cluster, 2)  # n0 → n1 → n0
    _save(cluster, 0, 0, range(1, 4))
    until(lambda: _replicated(cluster, 0)["replicated"] == 3, what="step 3 on n1")
    before = daemon_state(cluster, 0)["replication"]
    gate = httpx.get(cluster.daemons[0].url + "/v1/gate").json()["bytes_by_priority"]
    cluster.start_daemon("--gate-chunk-kb", "64", budget_mb=64)  # n0 → n1 → n2 → n0

    def sent_again() -> dict[str, Any] | None:
        r = daemon_state(cluster, 0)["replication"]
        return r if r["pushes"] >= before["pushes"] + 2 and r["pending"] == 0 else None

    sent = until(sent_again, what="n0's newest two versions sent to n1 again")
    assert httpx.get(cluster.daemons[0].url + "/v1/gate").json()["bytes_by_priority"] == gate  # no body sent again
    assert sent["successor"] == "n1" and sent["pushes_already_there"] == 2 and sent["pushes_resumed"] == before["pushes_resumed"]


def test_restore_gathers_razored_pieces_of_dp_peers_from_other_nodes(cluster: LocalCluster) -> None:
    start_ring(cluster, 3)
    _save(cluster, 0, 0, range(5, 7), dp=2)  # rank 0 saves on n0, rank 1 on n1
    _save(cluster, 1, 1, range(5, 7), dp=2)
    until(lambda: _status(cluster)["restorable_step"] == 6)
    # rank 0 restarts on n2: its own shard and rank 1's piece of the replicated state come from peers
    ck = Checkpointer("job", Layout(dp=2, dp_rank=0), socket_path=cluster.socket(2))
    got = ck.restore()
    ck.close()
    assert got is not None and got.step == 6 and torch.equal(got.state["w"], _state(6, 0)["w"])


def test_a_push_resumes_and_counts_only_once_verified(cluster: LocalCluster) -> None:
    start_ring(cluster, 1)
    url = cluster.daemons[0].url + "/v1/replicas/job/dpX/7"
    data = bytes(range(256)) * 1024
    import xxhash

    meta = {"nbytes": len(data), "checksum": xxhash.xxh3_64_hexdigest(data), "header": {"layout_roles": ["dpX"]}, "source": "elsewhere"}
    assert httpx.post(url + "/begin", json=meta).status_code == 401  # the peer API needs the token
    mistyped = httpx.post(url + "/begin", json={**meta, "header": {"layout_roles": "dpX"}}, headers=AUTH)
    assert mistyped.status_code == 422 and "layout_roles" in mistyped.text  # refused as it arrives, not at a restore
    assert httpx.post(url + "/begin", json=meta, headers=AUTH).json() == {"received": 0}
    assert httpx.put(url, params={"offset": 0}, content=data[:100_000], headers=AUTH).json() == {"received": 100_000}
    # the sender went away; when it comes back it is told where to resume
    assert httpx.post(url + "/begin", json=meta, headers=AUTH).json() == {"received": 100_000}
    wrong = httpx.put(url, params={"offset": 0}, content=data[:10], headers=AUTH)
    assert wrong.status_code == 409 and "resume from there" in wrong.text
    assert httpx.post(url + "/commit", headers=AUTH).status_code == 409  # incomplete: not a replica
    assert httpx.put(url, params={"offset": 100_000}, content=b"\0" * (len(data) - 100_000), headers=AUTH).status_code == 200
    bad = httpx.post(url + "/commit", headers=AUTH)
    assert bad.status_code == 422 and "checksum" in bad.text  # corrupt in transit: discarded
    assert daemon_state(cluster, 0)["replicas"] == []
    assert httpx.post(url + "/begin", json=meta, headers=AUTH).json() == {"received": 0}
    assert httpx.put(url, params={"offset": 0}, content=data, headers=AUTH).status_code == 200
    assert httpx.post(url + "/commit", headers=AUTH).json()["ok"]
    assert [(r["step"], r["kind"]) for r in daemon_state(cluster, 0)["replicas"]] == [(7, "replica")]
    assert httpx.get(
        cluster.daemons[0].url + "/v1/state/job/dpX/7/shard", params={"offset": 256, "length": 4}, headers=AUTH
    ).content == bytes(range(4))


def test_a_whole_push_is_one_request_and_a_cut_one_resumes_through_begin(cluster: LocalCluster) -> None:
    import xxhash

    from statestore.transport.http import meta_prefix

    start_ring(cluster, 1)
    base = cluster.daemons[0].url + "/v1/replicas/job/dpX"
    data = bytes(range(256)) * 1024
    meta = {"nbytes": len(data), "checksum": xxhash.xxh3_64_hexdigest(data), "header": {"layout_roles": ["dpX"]}, "source": "elsewhere"}
    assert httpx.put(base + "/7/whole", content=meta_prefix(meta) + data).status_code == 401
    whole = httpx.put(base + "/7/whole", content=meta_prefix(meta) + data, headers=AUTH)
    assert whole.json() == {"received": len(data), "checksum": meta["checksum"]}  # received, verified, committed
    assert [(r["step"], r["kind"]) for r in daemon_state(cluster, 0)["replicas"]] == [(7, "replica")]
    # cut off after 100 kB: nothing counts, what arrived stays, and the next try resumes there
    cut = httpx.put(base + "/8/whole", content=meta_prefix(meta) + data[:100_000], headers=AUTH)
    assert cut.status_code == 409 and "only 100000" in cut.text
    again = httpx.put(base + "/8/whole", content=meta_prefix(meta) + data, headers=AUTH)
    assert again.status_code == 409 and "resume through begin" in again.text
    assert httpx.post(base + "/8/begin", json=meta, headers=AUTH).json() == {"received": 100_000}
    assert httpx.put(base + "/8", params={"offset": 100_000}, content=data[100_000:], headers=AUTH).status_code == 200
    assert httpx.post(base + "/8/commit", headers=AUTH).json()["ok"]
    assert sorted(r["step"] for r in daemon_state(cluster, 0)["replicas"]) == [7, 8]
    # a body that does not start with its metadata changes nothing
    for junk in (b"", b"\x05\x00", b"\x03\x00\x00\x00[1]" + data):
        bad = httpx.put(base + "/9/whole", content=junk, headers=AUTH)
        assert bad.status_code == 422 and "metadata" in bad.text
    assert sorted(r["step"] for r in daemon_state(cluster, 0)["replicas"]) == [7, 8]


def test_losing_a_node_and_its_successor_falls_back_to_the_durable_tier(cluster: LocalCluster, tmp_path: Path) -> None:
    durable = ("--durable-dir", str(tmp_path / "durable"), "--durable-every", "1")
    start_ring(cluster, 4, *durable)  # ring n0 → n1 → n2 → n3
    for node in range(4):
        _save(cluster, node, node, range(1, 3), dp=4)
    # on its final successor (a node that started early may first have pushed to another)
    until(
        lambda: all({f"n{r}", f"n{(r + 1) % 4}"} <= set(_held(cluster, f"dp{r}-pp0-tp0", 2)) for r in range(4)),
        what="every role replicated",
    )

    cluster.lose_node(2)  # every role still has a copy (n2's on n3)
    until(lambda: "n2" in _status(cluster)["dead"])
    got = Checkpointer("job", Layout(dp=4, dp_rank=0), socket_path=cluster.socket(1)).restore()
    assert got is not None and got.source == "memory" and got.step == 2

    # n0 and its successor n1 at once: role 0 has no copy in memory. (One after the other, n1
    # would first forward n0's replica to its own successor: a third copy, as designed.)
    cluster.lose_node(0)
    cluster.lose_node(1)
    until(lambda: {"n0", "n1"} <= set(_status(cluster)["dead"]))
    reply = _restorable_reply(cluster, 3, "dp0-pp0-tp0")
    assert reply["source"] == "durable" and reply["step"] == 2 and "durable tier" in reply["message"] and "dp0-pp0-tp0" in reply["message"]


@contextlib.contextmanager
def _stopped(proc: Proc) -> Iterator[Callable[[float], threading.Timer]]:
    """``proc`` SIGSTOPped (it cannot beat, nor take a push) for the block; yields a function
    that schedules its SIGCONT, which also happens on the way out."""
    timers: list[threading.Timer] = []

    def resume_after(seconds: float) -> threading.Timer:
        timers.append(threading.Timer(seconds, os.kill, (proc.pid, signal.SIGCONT)))
        timers[-1].start()
        return timers[-1]

    os.kill(proc.pid, signal.SIGSTOP)
    try:
        yield resume_after
    finally:
        for t in timers:
            t.cancel()
        os.kill(proc.pid, signal.SIGCONT)


def _replicated(c: LocalCluster, node: int, role: str = "dp0-pp0-tp0") -> dict[str, Any]:
    return daemon_state(c, node)["replication"]["roles"][f"job/{role}"]


def test_a_restarted_coordinator_keeps_commits_waiting_for_their_replica(cluster: LocalCluster) -> None:
    """A restarted data server's first ring views hold only the nodes that have beaten since;
    a commit made then must still wait until the successor holds it (found by the soak: n19
    committed unreplicated steps in that second and was lost)."""
    start_ring(cluster, 2)  # n0 → n1 → n0
    _save(cluster, 0, 0, range(1, 3))
    until(lambda: _replicated(cluster, 0)["replicated"] == 2, what="step 2 on n1")
    assert cluster.dataserver is not None
    port = int(cluster.dataserver.ready["port"])  # type: ignore[call-overload]
    with _stopped(cluster.daemons[1]) as resume_after:  # n1 cannot register with the new data server yet
        cluster.dataserver.kill()
        cluster.start_dataserver(port=port)
        until(lambda: _status(cluster)["ring"] == ["n0"], what="n0 registered with the new data server")
        resume_after(0.5)
        _save(cluster, 0, 0, range(3, 4))  # returns once step 3's commit is answered
        # answered only once the successor held it: it was never without one
        assert _replicated(cluster, 0) == {"committed": 3, "replicated": 3, "to": "n1"}
    until(lambda: _status(cluster)["ring"] == ["n0", "n1"], what="n1 back in the ring")
    assert daemon_state(cluster, 0)["replication"]["commit_wait_timeouts"] == 0


def test_a_commit_waits_while_its_successor_is_briefly_declared_dead(cluster: LocalCluster) -> None:
    """A live node declared dead for a moment (silent past the coordinator's limit, then back)
    leaves its predecessor alone in the ring; commits made then wait for it to return (the
    soak lost a node right after such a moment: its commits had no copy anywhere else)."""
    start_ring(cluster, 2)
    _save(cluster, 0, 0, range(1, 3))
    until(lambda: _replicated(cluster, 0)["replicated"] == 2, what="step 2 on n1")
    with _stopped(cluster.daemons[1]) as resume_after:
        until(lambda: "n1" in _status(cluster)["dead"], what="n1 declared dead")
        until(lambda: daemon_state(cluster, 0)["coordinator"]["successor"] is None, what="n0 alone in its ring")
        resume_after(0.5)
        _save(cluster, 0, 0, range(3, 4))
        assert _replicated(cluster, 0) == {"committed": 3, "replicated": 3, "to": "n1"}


def _restorable_reply(c: LocalCluster, node: int, role: str) -> dict[str, Any]:
    from ffplane_contract.control import Restorable
    from trainer_client._daemon_client import DaemonClient

    client = DaemonClient(c.socket(node), 30)
    try:
        return dict(client.call(Restorable("job", verify=False, roles=[role])).__dict__)
    finally:
        client.close()


def test_a_first_step_committed_by_some_roles_only_is_a_fresh_start_on_every_node(cluster: LocalCluster) -> None:
    """Rank 0 failed before its first commit; rank 1 committed step 0. Nothing was ever
    restorable, so every rank starts fresh (it used to be refused on the node that had to ask the
    coordinator — "a node and its ring successor were probably lost together" — while a
    one-daemon setup started fresh), and the restarted job then saves and restores as usual."""
    start_ring(cluster, 2)
    _save(cluster, 1, 1, range(0, 1), dp=2)
    until(lambda: _held(cluster, "dp1-pp0-tp0", 0) == ["n0", "n1"], what="step 0 of role 1 replicated")
    for node, rank in ((0, 0), (1, 1)):
        ck = Checkpointer("job", Layout(dp=2, dp_rank=rank), socket_path=cluster.socket(node))
        assert ck.restore() is None  # before: NotFoundError on n0
        ck.close()
    _save(cluster, 0, 0, range(0, 3), dp=2)
    _save(cluster, 1, 1, range(0, 3), dp=2)
    until(lambda: _status(cluster)["restorable_step"] == 2, what="step 2 restorable")
    got = Checkpointer("job", Layout(dp=2, dp_rank=1), socket_path=cluster.socket(0)).restore()
    assert got is not None and got.step == 2 and torch.equal(got.state["w"], _state(2, 0)["w"])
    logs = cluster.daemons[0].log()
    assert logs.count("nothing to restore, the job starts fresh") == 1, logs[-3000:]


def test_a_restore_more_than_one_step_back_says_so_naming_the_roles_and_steps(cluster: LocalCluster) -> None:
    start_ring(cluster, 2)
    _save(cluster, 0, 0, range(1, 5), dp=2)  # role 0 reached step 4 (and keeps 2..4), role 1 only step 2
    _save(cluster, 1, 1, range(1, 3), dp=2)
    until(lambda: "n1" in _held(cluster, "dp0-pp0-tp0", 4) and "n0" in _held(cluster, "dp1-pp0-tp0", 2), what="both roles replicated")
    reply = _restorable_reply(cluster, 0, "dp0-pp0-tp0")
    assert reply["step"] == 2
    assert "2 steps behind its newest copy (step 4)" in reply["message"] and "dp1-pp0-tp0" in reply["message"], reply["message"]
    assert "steps 3..4" in reply["message"] and "dp0-pp0-tp0" not in reply["message"].split(": ", 1)[1]
    assert daemon_state(cluster, 0)["restores_behind"] == 1
    metrics = httpx.get(cluster.daemons[0].url + "/metrics").text
    assert "ffplane_restores_behind_total 1.0" in metrics
