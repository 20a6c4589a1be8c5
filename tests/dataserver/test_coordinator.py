from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests._servers import TOKEN
from trainer_client import Checkpointer, Layout
from trainer_client.local_cluster import LocalCluster


def _until(fn: Callable[[], Any], timeout_s: float = 20) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.05)


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
    _until(lambda: _nodes(three)["ring"] == ["n0", "n1", "n2"])
    # a daemon learns the ring from its next heartbeat's answer
    view = _until(lambda: (v := httpx.get(three.daemons[0].url + "/v1/state").json()["coordinator"]).get("ring") == ["n0", "n1", "n2"] and v)
    assert view["successor"] == "n1" and view["dead"] == []


def test_a_silent_node_is_declared_dead_and_leaves_the_ring(three: LocalCluster) -> None:
    _until(lambda: _nodes(three)["ring"] == ["n0", "n1", "n2"])
    three.daemons[1].kill(signal.SIGKILL)
    assert three.dataserver is not None
    status = _until(lambda: (s := httpx.get(three.dataserver.url + "/v1/jobs/any/status").json())["dead"] == ["n1"] and s)  # type: ignore[union-attr]
    assert status["ring"] == ["n0", "n2"]
    assert _until(lambda: httpx.get(three.daemons[2].url + "/v1/state").json()["coordinator"].get("successor") == "n0")


def test_membership_rebuilt_after_a_dataserver_restart(tmp_path: Path, data_dir: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with LocalCluster(tmp_path, data_dir, TOKEN) as c:
        ds = c.start_dataserver(port=port)
        c.start_daemon(budget_mb=128)
        c.start_daemon(budget_mb=128)
        _until(lambda: _nodes(c)["ring"] == ["n0", "n1"])
        pids = [d.pid for d in c.daemons]
        ds.kill(signal.SIGKILL)
        c.start_dataserver(port=port)
        _until(lambda: _nodes(c)["ring"] == ["n0", "n1"])
        assert [d.pid for d in c.daemons] == pids and all(d.popen.poll() is None for d in c.daemons)


def test_restorable_step_spans_nodes_and_a_worker_exit_is_reported(three: LocalCluster, tmp_path: Path) -> None:
    assert three.dataserver is not None
    for rank in range(2):  # role dp0 on node n0, role dp1 on node n1
        ck = Checkpointer("job", Layout(dp=2, dp_rank=rank), socket_path=three.socket(rank))
        for step in range(rank, 4):  # n1's role has committed up to 3, n0's too; n0 also has 0
            ck.save(step, {"w": __import__("torch").ones(10) * step})
        ck.close()
    status = _until(lambda: (s := httpx.get(three.dataserver.url + "/v1/jobs/job/status").json())["restorable_step"] == 3 and s)  # type: ignore[union-attr]
    assert status["shard_locations"]["dp0-pp0-tp0"]["3"] == ["n0"] and status["shard_locations"]["dp1-pp0-tp0"]["3"] == ["n1"]
    # a worker process holding a connection to n2's daemon is SIGKILLed: n2 reports it at once
    code = f"import time; from trainer_client import Checkpointer; c = Checkpointer('job', socket_path={str(three.socket(2))!r}); c.save(0, {{'x': 1}}); c.wait(); print('ready', flush=True); time.sleep(60)"
    worker = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        assert worker.stdout is not None and worker.stdout.readline().strip() == "ready"
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        exits = _until(lambda: httpx.get(three.dataserver.url + "/v1/jobs/job/status").json()["worker_exits"])
        assert exits[-1]["pid"] == worker.pid and exits[-1]["node"] == "n2" and exits[-1]["role"] == "dp0-pp0-tp0"
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
