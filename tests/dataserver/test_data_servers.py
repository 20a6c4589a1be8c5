"""Several data servers over one etcd: shared job records (a stale plan is never served), one
coordinator at a time by lease, and a coordinating server SIGKILLed mid-epoch while readers go on
through their daemons with every sample exactly once and the batches the plan names."""

from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

from ffplane_harness.etcd_cluster import EtcdCluster
from ffplane_harness.local_cluster import LocalCluster
from ffplane_harness.netns import Netns
from ffplane_runtime.etcd import ALIVE_KEY, DEAD_PREFIX
from tests._servers import TOKEN, Proc, start, until
from trainer_client import DataLoader

AUTH = {"Authorization": f"Bearer {TOKEN}"}
JOB = {"name": "j1", "dataset": "tokens", "dp": 2, "batch_per_rank": 8, "seed": 3, "max_steps": 40}


def _serve(tmp_path: Path, data_dir: Path, name: str, *extra: str) -> Proc:
    return start("dataserver", ["serve", "--data-dir", str(data_dir), "--port", "0", *extra], tmp_path, name)


def _batch_indices(ds: Proc, dp_rank: int, step: int) -> list[int]:
    import pyarrow as pa

    r = httpx.get(f"{ds.url}/v1/jobs/j1/batches", params={"dp_rank": dp_rank, "start": step}, headers=AUTH)
    assert r.status_code == 200, r.text
    return [int(i) for i in pa.ipc.open_stream(r.content).read_all().column("_sample_index").to_pylist()]


def _plan(ds: Proc, dp_rank: int, step: int) -> list[int]:
    r = httpx.get(f"{ds.url}/v1/jobs/j1/plan", params={"dp_rank": dp_rank, "step": step})
    assert r.status_code == 200, r.text
    indices: list[int] = r.json()["indices"]
    return indices


def test_servers_share_job_records_and_one_coordinates(tmp_path: Path, data_dir: Path, etcd: EtcdCluster) -> None:
    state = tmp_path / "jobs"
    # a job created before etcd was used: its record and served step move into etcd
    plain = _serve(tmp_path, data_dir, "plain", "--state-dir", str(state))
    try:
        assert httpx.post(plain.url + "/v1/jobs", json={**JOB, "name": "old"}, headers=AUTH).status_code == 201
        r = httpx.get(f"{plain.url}/v1/jobs/old/batches", params={"dp_rank": 0, "start": 0, "count": 4}, headers=AUTH)
        assert r.status_code == 200
    finally:
        plain.stop()
    procs: list[Proc] = []
    try:
        a = _serve(tmp_path, data_dir, "a", "--state-dir", str(state), "--etcd", etcd.endpoints)
        procs.append(a)
        assert httpx.get(a.url + "/v1/leader").json()["leading"] is True  # answered once it has campaigned
        b = _serve(tmp_path, data_dir, "b", "--state-dir", str(tmp_path / "b-jobs"), "--etcd", etcd.endpoints)
        procs.append(b)
        assert httpx.get(b.url + "/v1/leader").json() == {"url": b.url, "leading": False, "leader": a.url}
        assert httpx.get(b.url + "/v1/jobs/old").json()["served_step"] == 3  # imported from a's files, read by b

        assert httpx.post(b.url + "/v1/jobs", json=JOB, headers=AUTH).status_code == 201  # created on a follower
        assert httpx.post(a.url + "/v1/jobs", json=JOB, headers=AUTH).status_code == 200  # the same job on the other
        assert httpx.post(a.url + "/v1/jobs", json={**JOB, "seed": 4}, headers=AUTH).status_code == 409
        # a worker without a daemon given both servers, the first one down, reads from the other
        direct = DataLoader("j1", 1, dataserver=f"http://127.0.0.1:9,{b.url}", token=TOKEN, socket_path=tmp_path / "none.sock", end_step=2)
        assert [batch["_sample_index"].tolist() for batch in direct] == [_plan(a, 1, 0), _plan(a, 1, 1)]
        for step in range(10):  # served by b: a must know these steps are out
            assert _batch_indices(b, 0, step) == _plan(a, 0, step)
        assert httpx.get(a.url + "/v1/jobs/j1").json()["served_step"] == 9
        gen = {"start_step": 5, "dp": 1, "batch_per_rank": 16}
        r = httpx.post(b.url + "/v1/jobs/j1/generations", json=gen, headers=AUTH)  # b does not coordinate
        assert r.status_code == 421 and r.headers["X-FFplane-Leader"] == a.url, r.text
        r = httpx.post(a.url + "/v1/jobs/j1/generations", json=gen, headers=AUTH)
        assert r.status_code == 409 and "up to step 9 have been served" in r.json()["detail"], r.text
        r = httpx.post(a.url + "/v1/jobs/j1/generations", json={**gen, "start_step": 12}, headers=AUTH)
        assert r.status_code == 200, r.text
        # b planned step 12 with two ranks; its cached record is stale, and it must not serve it
        assert httpx.get(f"{b.url}/v1/jobs/j1/batches", params={"dp_rank": 1, "start": 12}, headers=AUTH).status_code == 416
        assert _batch_indices(b, 0, 12) == _plan(a, 0, 12) and len(_plan(a, 0, 12)) == 16
        beat = {"node_id": "n9", "address": "http://127.0.0.1:9", "budget_bytes": 1 << 20}
        r = httpx.post(b.url + "/v1/nodes/heartbeat", json=beat, headers=AUTH)  # a daemon's beat: sent on
        assert r.status_code == 421 and r.headers["X-FFplane-Leader"] == a.url, r.text

        a.stop()  # a clean stop hands coordination over at once (the lease is revoked)
        until(lambda: httpx.get(b.url + "/v1/leader").json()["leading"], what="b coordinating after a stopped")
        again = _serve(tmp_path, data_dir, "a2", "--state-dir", str(state), "--etcd", etcd.endpoints)
        procs.append(again)
        assert httpx.get(again.url + "/v1/leader").json()["leader"] == b.url  # back as a follower
        view = httpx.get(again.url + "/v1/jobs/j1").json()
        assert view["served_step"] == 12 and [g["start_step"] for g in view["generations"]] == [0, 12]
        for member in etcd.members:  # no quorum: what needs a job record says so, and nothing else breaks
            member.kill()
        r = httpx.get(again.url + "/v1/jobs/j1", timeout=30)
        assert r.status_code == 503 and "job records cannot be reached" in r.json()["detail"], r.text
        assert httpx.get(again.url + "/v1/health").status_code == 200
    finally:
        for p in procs:
            p.kill()


def test_the_coordinating_server_sigkilled_mid_epoch_readers_go_on_exactly_once_and_another_takes_over(
    tmp_path: Path, data_dir: Path, net: Netns | None
) -> None:
    members = net.nodes[-3:] if net is not None else []
    etcd = EtcdCluster(tmp_path, [m.addr for m in members] or None, [m.exec_argv for m in members] or None)
    etcd.start()
    cluster = LocalCluster(tmp_path, data_dir, TOKEN, net=net)
    try:
        first = cluster.start_dataserver("--etcd", etcd.endpoints)
        assert cluster.leader() is first  # the first leads before the second starts
        second = cluster.start_dataserver("--etcd", etcd.endpoints, index=1, node=4)
        steps = 2 * -(-300 // 16)  # two epochs of 300 samples, dp=2 x batch 8 per step
        assert httpx.post(second.url + "/v1/jobs", json={**JOB, "max_steps": steps}, headers=AUTH).status_code == 201
        for _ in range(3):  # n2 reads nothing: it is lost together with the coordinator
            cluster.start_daemon("--window", "2")
        until(lambda: httpx.get(first.url + "/v1/nodes").json()["ring"] == ["n0", "n1", "n2"], what="three nodes registered")
        # the coordinator keeps its alive nodes in etcd a sweep (0.2 s) after they change
        alive = lambda: json.loads(getattr(etcd.client().get(ALIVE_KEY), "value", b"{}"))  # noqa: E731
        until(lambda: sorted(alive()) == ["n0", "n1", "n2"], what="three nodes kept in etcd for a successor")
        loaders = [DataLoader("j1", r, token=TOKEN, socket_path=cluster.socket(r)) for r in range(2)]
        its = [iter(ld) for ld in loaders]
        seen: list[list[np.ndarray]] = [[], []]
        for step in range(steps):
            if step == 6:  # mid-epoch, with steps in flight: the coordinator and half the batch server go
                served = [_metric(d, "ffplane_dataserver_steps_served_total") for d in (first, second)]
                assert all(n > 0 for n in served), f"the daemons did not spread their fetches: {served}"
                first.kill(signal.SIGKILL)
                cluster.daemons[2].kill()
            for r in range(2):
                batch = next(its[r])
                seen[r].append(batch["_sample_index"].numpy().copy())
        assert all(ld.source == "daemon" for ld in loaders)
        for r in range(2):
            for step in range(steps):  # the batches the plan names, from whichever server served them
                assert seen[r][step].tolist() == _plan(second, r, step), (r, step)
        stream = np.concatenate([np.concatenate([seen[0][s], seen[1][s]]) for s in range(steps)])
        for epoch in range(2):
            assert Counter(stream[epoch * 300 : (epoch + 1) * 300].tolist()) == Counter(range(300))

        assert cluster.leader() is second  # coordination taken over: the node lost with the old coordinator,
        # which never beat to the new one, is declared dead all the same, for the rendezvous too
        status = lambda: httpx.get(second.url + "/v1/jobs/j1/status").json()  # noqa: E731
        until(lambda: status().get("dead") == ["n2"] and status()["ring"] == ["n0", "n1"], what="n2 dead, n0 and n1 in the ring")
        until(lambda: etcd.client().get(DEAD_PREFIX + b"n2") is not None, what="n2 published dead in etcd")
        cluster.daemons[1].kill()  # and a node lost now
        until(lambda: status().get("dead") == ["n1", "n2"], what="n1 declared dead")
    finally:
        cluster.close()
        etcd.close()


def _metric(ds: Proc, name: str) -> float:
    text = httpx.get(ds.url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))
