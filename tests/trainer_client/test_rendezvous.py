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
from trainer_client.rendezvous import EtcdRendezvousBackend, EtcdStore

STEPS = 24


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
        spare = jobs.launch_spare("frozen", 2, nodes)
        jobs.wait_step(nodes, 8, since)
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
