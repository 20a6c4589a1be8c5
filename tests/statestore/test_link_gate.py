"""The idle-link gate with real daemons: a training process's hint holds replication back until the
collective ends — except the push a commit's answer waits for; a killed process's stuck hint does
not hold it forever; the ops API shows it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from ffplane_contract.control import Get, Open
from ffplane_harness.local_cluster import LocalCluster
from tests._servers import TOKEN, until
from trainer_client import Checkpointer, LinkHints


def _pair(tmp_path: Path, data_dir: Path, *extra: str) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path, data_dir, TOKEN) as c:
        c.start_dataserver()
        c.start_daemon(*extra, budget_mb=64)
        c.start_daemon(*extra, budget_mb=64)
        until(lambda: httpx.get(c.daemons[0].url + "/v1/state").json()["coordinator"].get("successor") == "n1")
        yield c


@pytest.fixture
def pair(tmp_path: Path, data_dir: Path) -> Iterator[LocalCluster]:
    """Two daemons whose commits do not wait for replication: the gate alone decides."""
    yield from _pair(tmp_path, data_dir, "--replica-max-lag", "0")


@pytest.fixture
def bounded_pair(tmp_path: Path, data_dir: Path) -> Iterator[LocalCluster]:
    """Two daemons as deployed: a commit is answered once its replica is on the successor."""
    yield from _pair(tmp_path, data_dir)


def _get(c: LocalCluster, path: str) -> dict[str, Any]:
    return httpx.get(c.daemons[0].url + path).json()


def _replicated(c: LocalCluster) -> int | None:
    return ((_get(c, "/v1/state")["replication"] or {})["roles"].get("job/dp0-pp0-tp0") or {}).get("replicated")


def test_a_hint_holds_replication_until_the_collective_ends(pair: LocalCluster) -> None:
    ck = Checkpointer("job", socket_path=pair.socket(0))
    hints = LinkHints(pair.socket(0))
    try:
        with hints.collective():
            gate = _get(pair, "/v1/gate")
            assert gate["open"] is False and gate["closed_because"] == "hint"
            ck.save(1, {"w": torch.ones(1 << 18)})
            ck.wait()
            # committed here, but not a byte crosses the link while TRAIN runs
            until(lambda: _get(pair, "/v1/gate")["pauses"] >= 1, what="the push to wait at the gate")
            assert _replicated(pair) is None and _get(pair, "/v1/gate")["bytes_by_priority"]["replicate"] == 0
            # waiting costs a look per poll (1 ms), not a spinning loop: a bound that only a
            # faster poll can break (a slow machine looks less often)
            looks, since = _get(pair, "/v1/gate")["looks"], time.monotonic()
            time.sleep(0.3)
            looks_per_ms = (_get(pair, "/v1/gate")["looks"] - looks) / ((time.monotonic() - since) * 1e3)
            assert looks_per_ms <= 1.5, f"{looks_per_ms:.0f} looks per ms while a push waits"
        until(lambda: _replicated(pair) == 1, what="replication once the collective ended")
        gate = _get(pair, "/v1/gate")
        assert gate["open"] and gate["bytes_by_priority"]["replicate"] >= 1 << 20 and gate["paused_s"] > 0
        assert "ffplane_gate_paused_seconds" in httpx.get(pair.daemons[0].url + "/metrics").text
    finally:
        hints.close()
        ck.close()


def test_a_commit_is_answered_once_its_replica_exists_even_while_a_collective_runs(bounded_pair: LocalCluster) -> None:
    ck = Checkpointer("job", socket_path=bounded_pair.socket(0))
    hints = LinkHints(bounded_pair.socket(0))
    try:
        with hints.collective():
            assert _get(bounded_pair, "/v1/gate")["closed_because"] == "hint"
            for step in (1, 2):
                ck.save(step, {"w": torch.full((1 << 18,), float(step))})
                ck.wait()
                # the answer waited for the push, which passed the hint (else the node's other
                # workers would wait for this one in the collective while it waits for them)
                assert _replicated(bounded_pair) == step
        waits = _get(bounded_pair, "/v1/state")["replication"]
        assert waits["commit_waits"] >= 2 and waits["commit_wait_timeouts"] == 0
        assert "ffplane_replication_commit_wait_seconds" in httpx.get(bounded_pair.daemons[0].url + "/metrics").text
    finally:
        hints.close()
        ck.close()


def test_a_killed_worker_does_not_hold_the_gate(pair: LocalCluster) -> None:
    code = (
        "import sys, time\n"
        "from trainer_client import LinkHints\n"
        "h = LinkHints(sys.argv[1]); h._add(1); print('busy', flush=True); time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(pair.socket(0))], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2]
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "busy"
        until(lambda: _get(pair, "/v1/gate")["closed_because"] == "hint")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        until(lambda: _get(pair, "/v1/gate")["open"], what="the dead worker's hint to be dropped")
        assert not (pair.roots[0] / "hints" / str(proc.pid)).exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_rate_cap_throttles_every_state_transfer_including_durable_copies(tmp_path: Path, data_dir: Path) -> None:
    extra = ("--gate-rate-cap-mbit", "16", "--durable-dir", str(tmp_path / "durable"), "--durable-every", "1")
    with LocalCluster(tmp_path, data_dir, TOKEN) as c:
        c.start_dataserver()
        c.start_daemon(*extra, budget_mb=64)
        c.start_daemon(budget_mb=64)
        until(lambda: httpx.get(c.daemons[0].url + "/v1/state").json()["coordinator"].get("successor") == "n1")
        ck = Checkpointer("job", socket_path=c.socket(0))
        ck.save(1, {"w": torch.ones(1 << 19)})  # 2 MiB: about a second at 2 MB/s, each way
        ck.close()
        until(lambda: _replicated(c) == 1 and _get(c, "/v1/state")["durable_written"] == 1)
        gate = _get(c, "/v1/gate")
        assert gate["config"]["rate_cap_bytes_s"] == 2e6 and gate["throttled_s"] > 0
        assert gate["bytes_by_priority"]["replicate"] >= 2 << 20 and gate["bytes_by_priority"]["durable"] >= 2 << 20


def test_train_traffic_the_hints_did_not_announce_closes_the_gate(tmp_path: Path, data_dir: Path) -> None:
    from ffplane_harness.netns import Netns, available

    if available():
        pytest.skip(str(available()))
    with Netns(3, rate="1gbit") as net, LocalCluster(tmp_path, data_dir, TOKEN, net=net) as c:
        c.start_dataserver()
        a, b = net.nodes[1], net.nodes[2]
        c.start_daemon("--gate-iface", a.iface, "--gate-link-mbit", "1000", budget_mb=64)
        repo = Path(__file__).parents[2]
        sink = subprocess.Popen(
            b.exec_argv([sys.executable, "-m", "bench._traffic", "sink", "5401"]), cwd=repo, stdout=subprocess.PIPE, text=True
        )
        train = None
        try:
            assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
            assert _get(c, "/v1/gate")["open"]
            train = subprocess.Popen(
                a.exec_argv([sys.executable, "-m", "bench._traffic", "train", b.addr, "5401", "40", "8", "5"]),
                cwd=repo,
                stdout=subprocess.PIPE,
            )
            until(lambda: _get(c, "/v1/gate")["closed_because"] == "interface", what="the interface counters to close the gate")
            train.wait(timeout=120)
            until(lambda: _get(c, "/v1/gate")["open"], what="the gate to reopen once the link is quiet")
        finally:
            for p in (train, sink):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait()


def test_a_prefetch_held_by_a_hint_passes_once_a_reader_needs_it(tmp_path: Path, data_dir: Path) -> None:
    """Steps fetched ahead wait while TRAIN runs; when the reader reaches one still waiting at the
    gate it is the batch that reader blocks on, and holding it would hold the collective that
    holds the gate (seen as ~0.4 s stalls per step of the example job)."""
    from tests.conftest import create_job
    from trainer_client._daemon_client import DaemonClient

    with LocalCluster(tmp_path, data_dir, TOKEN) as c:
        ds = c.start_dataserver()
        create_job(ds, max_steps=30)
        c.start_daemon("--window", "4", budget_mb=64)
        hints = LinkHints(c.socket(0))
        client = DaemonClient(c.socket(0), timeout_s=10)
        try:
            with hints.collective():
                client.call(Open("j1", 0, TOKEN))
                client.call(Get(0))  # the batch a reader waits on always passes
                until(lambda: _get(c, "/v1/gate")["waiting"].get("prefetch", 0) > 0, what="prefetches held by the hint")
                for step in (1, 2, 3):  # each was fetched ahead as a prefetch and held
                    assert client.call(Get(step)).path
        finally:
            client.close()
            hints.close()
