"""torchrun with ``--rdzv-backend ffplane``: the rendezvous held by etcd, dead nodes named by the
coordinator. A training node silenced mid-step (its link cut in network namespaces, its processes
frozen on loopback: peers hang in a collective, no reset reaches them) is the node whose agent was rank 0 — it served the workers'
store, and under ``c10d`` would have held the rendezvous — and a warm spare takes its roles; the
job ends bitwise-equal to a failure-free run."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from ffplane_harness.etcd_cluster import EtcdCluster, available
from ffplane_harness.job_runner import LocalJobs
from ffplane_harness.netns import Netns
from tests._servers import until
from trainer_client.rendezvous import EtcdRendezvousBackend, EtcdStore

STEPS = 200  # the spare is launched at step 2, ready (torch imported) seconds later, then its agent joins


def test_the_store_and_backend_keep_c10d_and_torch_semantics(etcd: EtcdCluster) -> None:
    store = EtcdStore(etcd.client(), "/test/store", timeout=timedelta(seconds=1))
    store.set("a", b"1")
    assert store.get("a") == b"1"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.compare_set("c", "", "first") == b"first"  # a missing key is set only from ""
    assert store.compare_set("c", "wrong", "second") == b"first"
    assert store.compare_set("c", "first", "second") == b"second"
    assert store.compare_set("missing", "x", "y") == b"x"
    assert store.check(["a", "n"]) and not store.check(["a", "nothing"])
    with pytest.raises(LookupError, match="did not appear"):
        store.get("never")
    backend = EtcdRendezvousBackend(etcd.client(), "run")
    assert backend.get_state() is None
    ok = backend.set_state(b"s1")
    assert ok is not None and ok[2] is True
    stale = backend.set_state(b"s2", None)  # another writer got there first: theirs comes back
    assert stale is not None and stale[:2] == (b"s1", ok[1]) and stale[2] is False
    newer = backend.set_state(b"s3", ok[1])
    assert newer is not None and newer[2] is True and backend.get_state() == (b"s3", newer[1])


def test_a_silenced_rank0_node_is_replaced_by_a_warm_spare_and_the_job_ends_bitwise(tmp_path: Path, net: Netns | None) -> None:
    """In namespaces the node's link is cut; on loopback its processes are frozen (SIGSTOP)."""
    if available():
        pytest.skip(str(available()))
    jobs = LocalJobs(tmp_path, STEPS, net=net)
    try:
        jobs.prepare(["reference", "frozen"], daemons=3, rendezvous="ffplane")
        jobs.wait_done(jobs.launch_job("reference", [0, 1]))
        since = time.time()
        nodes = jobs.launch_job("frozen", [0, 1])
        jobs.wait_step(nodes, 2, since)
        spare = jobs.launch_spare("frozen", 2, nodes)  # returns once its zygote is ready; its agent then starts
        jobs.wait_step(nodes, max(jobs.saved_steps(since).values()) + 12, since)  # its agent waiting in the rendezvous
        assert not [e for e in jobs.events("frozen") if e["node"] == "n2"], "the spare ran workers before any failure"

        host = next(e["node"] for e in reversed(jobs.events("frozen")) if e["kind"] == "saved" and e["rank"] == 0)
        victim = jobs.node_of(nodes, host)
        failed_at = time.time()
        if net is not None:  # the link dies: no reset reaches its peers, etcd or the coordinator
            net.cut(net.nodes[int(host[1:]) + 1])
        else:  # its workers, agent and zygote stop mid-step; so does its daemon
            victim.freeze()
            daemon = next(d for d in jobs.cluster.daemons if d.ready.get("node_id") == host)
            os.kill(daemon.pid, signal.SIGSTOP)
        detected_at = jobs.until(lambda: host in jobs.status("frozen").get("dead", []))
        saved_before = max(jobs.saved_steps(since, until=failed_at).values())
        survivors = [n for n in nodes if n is not victim] + [spare]
        jobs.wait_done(survivors, timeout_s=240)
        timeline = jobs.timeline("silenced rank-0 node", failed_at, detected_at, saved_before, "frozen")
    finally:
        jobs.close()

    # saves from the declaration on (one may land between ``failed_at`` and the cut)
    after = [e for e in jobs.events("frozen") if e["t"] > detected_at and e["kind"] == "saved"]
    assert {e["node"] for e in after} == {"n0", "n1", "n2"} - {host}  # the spare took the silenced node's place
    # the survivors dropped it on the coordinator's word, not on torch's keep-alive
    survivor_logs = "".join((tmp_path / f"frozen-{n.env['FFPLANE_NODE']}.log").read_text() for n in survivors)
    assert f"the coordinator declared node {host} dead" in survivor_logs
    assert 0 <= timeline["steps_lost"] <= 1
    ref, got = torch.load(tmp_path / "reference" / "final.pt"), torch.load(tmp_path / "frozen" / "final.pt")
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


@pytest.mark.parametrize("declared_after_s", [0.15, 0.4])  # during the agents' joins; after the round completed
def test_a_node_declared_dead_for_a_moment_while_agents_rejoin_ends_in_one_round(etcd: EtcdCluster, declared_after_s: float) -> None:
    """Both agents restart (a worker crashed when its daemon was killed); the daemon comes back
    1.5 s later, after the coordinator declared the node dead: its dead key lives for ~0.4 s while
    the agents rejoin. A complete round that lost a member was kept complete, so one agent
    finished with the old ranks and waited for a rank 0 that never came while the other waited for
    a next round that never came (the 1,000-failure soak hung 120 s on this). Now the round is
    reopened and both agents end in the same round, ranks 0 and 1 of 2."""
    import json
    import threading

    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from ffplane_runtime.etcd import DEAD_PREFIX
    from trainer_client.rendezvous import create_handler

    client = etcd.client()
    run = f"blip{int(declared_after_s * 100)}"

    def handler(node: str):  # type: ignore[no-untyped-def]
        params = RendezvousParameters(
            "ffplane", ",".join(client.endpoints), run, 2, 2, local_addr="127.0.0.1", node=node,
            join_timeout="20", last_call_timeout="1", keep_alive_interval="1", keep_alive_max_attempt="3",
        )  # fmt: skip
        return create_handler(params)

    a, b = handler("nA"), handler("nB")
    found: dict[str, object] = {}

    def agent(h, name: str, start_after_s: float, watch_s: float) -> None:  # type: ignore[no-untyped-def]
        """An agent: rendezvous, then its monitor loop (restart when nodes wait) for ``watch_s``."""
        time.sleep(start_after_s)
        try:
            info = h.next_rendezvous()
            end = time.monotonic() + watch_s
            while time.monotonic() < end:
                time.sleep(0.2)
                if h.num_nodes_waiting() > 0:
                    info, end = h.next_rendezvous(), time.monotonic() + watch_s
            found[name] = (h._state_holder.state.round, info.world_size, info.rank)
        except Exception as exc:  # noqa: BLE001 - the finding
            found[name] = repr(exc)

    def both(watch_s: float, b_after_s: float) -> None:
        threads = [
            threading.Thread(target=agent, args=(a, "a", 0, watch_s)),
            threading.Thread(target=agent, args=(b, "b", b_after_s, watch_s)),
        ]
        for t in threads:
            t.start()
        if watch_s:  # nA declared dead (its daemon was slow to come back), then back in the ring
            time.sleep(declared_after_s)
            client.put(DEAD_PREFIX + b"nA", json.dumps({"declared_at": time.time()}).encode())
            time.sleep(0.4)
            client.delete(DEAD_PREFIX + b"nA")
        for t in threads:
            t.join()

    both(0, 0)  # the first round
    found.clear()
    both(3, 0.2)  # both agents restart, nA first
    try:
        assert isinstance(found["a"], tuple) and isinstance(found["b"], tuple), found
        assert found["a"][0] == found["b"][0], f"the agents ended in different rounds: {found}"
        assert found["a"][1] == found["b"][1] == 2 and {found["a"][2], found["b"][2]} == {0, 1}, found
    finally:
        for h in (a, b):
            h.shutdown()


def test_a_verdict_on_a_node_whose_agent_still_beats_changes_nothing(etcd: EtcdCluster) -> None:
    """The coordinator declares a node dead when its daemon falls silent; a daemon restarting
    (killed, or rebuilding its index) on a node whose agent lives is not a dead agent. Dropping
    that agent split a round it had already joined (the 1,000-failure soak hung 120 s at failure
    349). Both agents stay in their round while the verdict stands; once the agent falls silent
    too, the survivor is told to restart at once."""
    import json
    import threading

    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from ffplane_runtime.etcd import DEAD_PREFIX
    from trainer_client.rendezvous import create_handler

    client = etcd.client()

    def handler(node: str):  # type: ignore[no-untyped-def]
        params = RendezvousParameters(
            "ffplane", ",".join(client.endpoints), "beats", 2, 2, local_addr="127.0.0.1", node=node,
            join_timeout="20", last_call_timeout="1", keep_alive_interval="1", keep_alive_max_attempt="10",
        )  # fmt: skip
        return create_handler(params)

    a, b = handler("nA"), handler("nB")
    try:
        threads = [threading.Thread(target=h.next_rendezvous) for h in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        round_no = b._state_holder.state.round
        client.put(DEAD_PREFIX + b"nA", json.dumps({"declared_at": time.time()}).encode())
        end = time.monotonic() + 2.5  # longer than two keep-alive intervals: nA's agent beats through it
        waiting = set()
        while time.monotonic() < end:
            waiting |= {a.num_nodes_waiting(), b.num_nodes_waiting()}
            time.sleep(0.1)
        assert waiting == {0} and b._state_holder.state.round == round_no
        assert len(b._state_holder.state.participants) == 2
        a._stop_heartbeats()  # now nA's agent is silent too (its node is gone)
        until(lambda: b.num_nodes_waiting() > 0, timeout_s=8, what="the survivor told to restart")  # torch alone: 10 beats
        assert {repr(n) for n in b._state_holder.state.participants} <= {repr(b._this_node)}
    finally:
        client.delete(DEAD_PREFIX + b"nA")
        for h in (a, b):
            h.shutdown()
