from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ffplane_contract import heartbeat as co
from ffplane_harness.local_cluster import LocalCluster
from tests._servers import TOKEN, until
from trainer_client import Checkpointer, Layout


@pytest.fixture
def three(tmp_path: Path, data_dir: Path) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path, data_dir, TOKEN) as c:
        c.start_dataserver()
        for _ in range(3):
            c.start_daemon(budget_mb=128)
        yield c


def _nodes(c: LocalCluster) -> dict[str, Any]:
    assert c.dataserver is not None
    return httpx.get(c.dataserver.url + "/v1/nodes").json()


def test_daemons_register_and_get_the_ring(three: LocalCluster) -> None:
    until(lambda: _nodes(three)["ring"] == ["n0", "n1", "n2"])
    # a daemon learns the ring from its next heartbeat's answer
    view = until(lambda: (v := httpx.get(three.daemons[0].url + "/v1/state").json()["coordinator"]).get("ring") == ["n0", "n1", "n2"] and v)
    assert view["successor"] == "n1" and view["dead"] == []


def test_a_silent_node_is_declared_dead_and_leaves_the_ring(three: LocalCluster) -> None:
    until(lambda: _nodes(three)["ring"] == ["n0", "n1", "n2"])
    three.daemons[1].kill(signal.SIGKILL)
    assert three.dataserver is not None
    status = until(lambda: (s := httpx.get(three.dataserver.url + "/v1/jobs/any/status").json())["dead"] == ["n1"] and s)  # type: ignore[union-attr]
    assert status["ring"] == ["n0", "n2"]
    assert until(lambda: httpx.get(three.daemons[2].url + "/v1/state").json()["coordinator"].get("successor") == "n0")


def test_membership_rebuilt_after_a_dataserver_restart(tmp_path: Path, data_dir: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with LocalCluster(tmp_path, data_dir, TOKEN) as c:
        ds = c.start_dataserver(port=port)
        c.start_daemon(budget_mb=128)
        c.start_daemon(budget_mb=128)
        until(lambda: _nodes(c)["ring"] == ["n0", "n1"])
        pids = [d.pid for d in c.daemons]
        ds.kill(signal.SIGKILL)
        c.start_dataserver(port=port)
        until(lambda: _nodes(c)["ring"] == ["n0", "n1"])
        assert [d.pid for d in c.daemons] == pids and all(d.popen.poll() is None for d in c.daemons)


def test_restorable_step_spans_nodes_and_a_worker_exit_is_reported(three: LocalCluster, tmp_path: Path) -> None:
    assert three.dataserver is not None
    for rank in range(2):  # role dp0 on node n0, role dp1 on node n1
        ck = Checkpointer("job", Layout(dp=2, dp_rank=rank), socket_path=three.socket(rank))
        for step in range(rank, 4):  # n1's role has committed up to 3, n0's too; n0 also has 0
            ck.save(step, {"w": __import__("torch").ones(10) * step})
        ck.close()
    until(lambda: httpx.get(three.dataserver.url + "/v1/jobs/job/status").json()["restorable_step"] == 3)  # type: ignore[union-attr]
    # each role's own node holds step 3 (its ring successor may list a replica too, maybe first)
    assert until(lambda: "n0" in httpx.get(three.dataserver.url + "/v1/jobs/job/status").json()["shard_locations"]["dp0-pp0-tp0"]["3"])  # type: ignore[union-attr]
    assert until(lambda: "n1" in httpx.get(three.dataserver.url + "/v1/jobs/job/status").json()["shard_locations"]["dp1-pp0-tp0"]["3"])  # type: ignore[union-attr]
    # a worker process holding a connection to n2's daemon is SIGKILLed: n2 reports it at once
    code = f"import time; from trainer_client import Checkpointer; c = Checkpointer('job', socket_path={str(three.socket(2))!r}); c.save(0, {{'x': 1}}); c.wait(); print('ready', flush=True); time.sleep(60)"
    worker = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        assert worker.stdout is not None and worker.stdout.readline().strip() == "ready"
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        exits = until(lambda: httpx.get(three.dataserver.url + "/v1/jobs/job/status").json()["worker_exits"])
        assert exits[-1]["pid"] == worker.pid and exits[-1]["node"] == "n2" and exits[-1]["role"] == "dp0-pp0-tp0"
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def _node(c: LocalCluster, node_id: str) -> dict[str, Any]:
    assert c.dataserver is not None
    return httpx.get(f"{c.dataserver.url}/v1/nodes/{node_id}").json()


def test_daemons_beat_over_udp_and_a_killed_one_is_declared_dead(three: LocalCluster) -> None:
    until(lambda: _nodes(three)["ring"] == ["n0", "n1", "n2"])
    # steady state: liveness comes from datagrams, not from HTTP heartbeats
    first = until(lambda: (n := _node(three, "n1"))["udp_beats"] >= 2 and n)
    later = until(lambda: (n := _node(three, "n1"))["udp_beats"] >= first["udp_beats"] + 3 and n)
    assert later["http_beats"] == first["http_beats"] and later["alive"]
    # the ring view reaches the daemons with the alive members' addresses
    addresses = {n: m["address"] for n, m in _nodes(three)["members"].items()}
    until(lambda: httpx.get(three.daemons[2].url + "/v1/state").json()["coordinator"].get("members") == addresses)
    three.daemons[1].kill(signal.SIGKILL)
    until(lambda: not _node(three, "n1")["alive"])
    assert _nodes(three)["ring"] == ["n0", "n2"]
    # the others learn it from the membership events in their beats' answers
    view = until(lambda: (v := httpx.get(three.daemons[2].url + "/v1/state").json()["coordinator"])["dead"] == ["n1"] and v)
    assert view["successor"] == "n0" and view["ring"] == ["n0", "n2"] and set(view["members"]) == {"n0", "n2"}


class _Udp:
    """A hand-made daemon speaking the coordinator's datagrams."""

    def __init__(self, c: LocalCluster, node_id: str, key: bytes = TOKEN.encode()) -> None:
        assert c.dataserver is not None
        self.url, self.node_id, self.key = c.dataserver.url, node_id, key
        self.session, self.counter = os.urandom(8), 0
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.settimeout(10)
        self.addr = (c.dataserver.url.split("//")[1].split(":")[0], _nodes(c)["udp_port"])

    def register(self, address: str = "http://10.9.9.9:1") -> dict[str, Any]:
        body = {
            "node_id": self.node_id,
            "address": address,
            "budget_bytes": 1,
            "udp": {"session": self.session.hex(), "counter": self.counter, "inv_version": 0},
        }
        r = httpx.post(self.url + "/v1/nodes/heartbeat", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200, r.text
        return r.json()

    def send(self, kind: int = co.KIND_BEAT, payload: bytes = b"", key: bytes | None = None, counter: int | None = None) -> int:
        if counter is None:
            self.counter += 1
            counter = self.counter
        self.sock.sendto(co.Beat(kind, self.node_id, self.session, counter, 0, 0, 0, payload).encode(key or self.key), self.addr)
        return counter

    def answer(self) -> tuple[int, int, int, int, int, bytes]:
        a = co.Answer.decode(self.key, self.sock.recv(65536))
        assert a is not None, "unauthentic answer"
        return a.status, a.view, a.counter, a.epoch, a.version, a.events


def test_datagrams_need_the_token_a_registration_and_a_fresh_counter(tmp_path: Path, data_dir: Path) -> None:
    with LocalCluster(tmp_path, data_dir, TOKEN) as c:
        c.start_dataserver()
        stranger = _Udp(c, "stranger")
        # an authentic datagram from a node never registered over HTTP creates no membership
        stranger.send()
        status, *_ = stranger.answer()
        assert status == co.STATUS_UNKNOWN and "stranger" not in _nodes(c)["members"]
        ghost = _Udp(c, "ghost")
        ghost.register()
        # forged: signed with another key, or a broken MAC; both dropped unanswered
        ghost.send(key=b"not-the-token")
        ghost.sock.sendto(co.Beat(co.KIND_BEAT, "ghost", ghost.session, 99, 0, 0, 0).encode(ghost.key)[:-1] + b"x", ghost.addr)
        ok = ghost.send()
        assert ghost.answer()[2] == ok  # the first answer is to the authentic beat sent after them
        # (counters are >=: a stray daemon of another test may hit this ephemeral port too)
        assert _node(c, "ghost")["udp_beats"] == 1 and _nodes(c)["stats"]["udp_rejected"] >= 2
        # a replayed datagram (an old counter) is dropped too
        ghost.send(counter=ok)
        ok2 = ghost.send()
        assert ghost.answer()[2] == ok2 and _node(c, "ghost")["udp_beats"] == 2 and _nodes(c)["stats"]["udp_replayed"] >= 1
        # another session of the same node id (a stranger guessing) is unknown
        ghost.session = os.urandom(8)
        ghost.send()
        assert ghost.answer()[0] == co.STATUS_UNKNOWN


def test_inventory_over_udp_is_decoded_for_status_and_view_events_follow(tmp_path: Path, data_dir: Path) -> None:
    with LocalCluster(tmp_path, data_dir, TOKEN) as c:
        ds = c.start_dataserver()
        a, b = _Udp(c, "a"), _Udp(c, "b")
        view = a.register()
        b.register("http://10.9.9.10:1")  # two live members cannot share an address
        inventory = {"job": {"dp0-pp0-tp0": [{"step": 7, "checksum": "0" * 16, "nbytes": 1, "layout_roles": ["dp0-pp0-tp0"]}]}}
        a.sock.sendto(
            co.Beat(co.KIND_INV, "a", a.session, 5, 5, view["epoch"], view["version"], co.encode_inventory(inventory, [{"pid": 1}])).encode(
                a.key
            ),
            a.addr,
        )
        a.counter = 5
        status, vflag, _, _, version, events = a.answer()
        # b joined after a's registration answer: a's answer carries that event
        assert status == co.STATUS_OK and vflag == co.VIEW_EVENTS and json.loads(events) == [["+", "b", "http://10.9.9.10:1"]]
        s = httpx.get(ds.url + "/v1/jobs/job/status").json()
        assert s["restorable_step"] == 7 and s["members"]["a"]["workers"] == [{"pid": 1}]
        # a beat naming another inventory version than the coordinator holds: resend it
        assert a.send(co.KIND_BEAT) and a.answer()[0] == co.STATUS_STALE
        # an unknown view epoch: fetch the whole view
        a.sock.sendto(co.Beat(co.KIND_BEAT, "a", a.session, 9, 5, 1, version).encode(a.key), a.addr)
        assert a.answer()[1] == co.VIEW_FULL
        # the encoded whole view is refreshed at most every 0.1 s (consistent with the version it names)
        full = until(lambda: (v := httpx.get(ds.url + "/v1/nodes/view", params={"node_id": "a"}).json())["version"] == version and v)
        assert full["members"] == {"a": "http://10.9.9.9:1", "b": "http://10.9.9.10:1"} and full["successor"] == "b" and full["dead"] == []
