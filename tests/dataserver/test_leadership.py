"""Coordination is held by one process, not by one URL (issue 39): two data servers given the
same ``--advertise-url`` on one etcd never both coordinate. The one that finds the leader key
naming its own URL under a lease that is still renewed (another live process) refuses to start,
exit 2, in one line; one that finds it later stays a follower and logs an error. A leader killed
and restarted with its URL still starts: its old lease runs out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from ffplane_harness.etcd_cluster import EtcdCluster
from tests._servers import TOKEN, Proc, start, until

TWIN_URL = "http://10.9.9.9:8470"  # no one connects to it here: only the leader key holds it


def _argv(data_dir: Path, etcd: EtcdCluster, url: str) -> list[str]:
    return ["serve", "--data-dir", str(data_dir), "--port", "0", "--etcd", etcd.endpoints, "--advertise-url", url]


def _serve(tmp_path: Path, etcd: EtcdCluster, name: str, url: str) -> Proc:
    return start("dataserver", [*_argv(tmp_path, etcd, url), "--state-dir", str(tmp_path / f"{name}-jobs")], tmp_path, name)


def _leading(ds: Proc) -> bool:
    leading: bool = httpx.get(ds.url + "/v1/leader", timeout=5).json()["leading"]
    return leading


def test_a_second_server_with_the_leaders_advertise_url_refuses_to_start(tmp_path: Path, etcd: EtcdCluster) -> None:
    first = _serve(tmp_path, etcd, "first", TWIN_URL)
    procs = [first]
    try:
        assert _leading(first)
        env = {k: v for k, v in os.environ.items() if not k.startswith("FFPLANE_")} | {"FFPLANE_TOKEN": TOKEN}
        argv = [sys.executable, "-m", "dataserver", *_argv(tmp_path, etcd, TWIN_URL), "--log-format", "text"]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env, check=False)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
        (line,) = r.stderr.strip().splitlines()
        assert line.startswith("dataserver serve: error:") and TWIN_URL in line and "own --advertise-url" in line, line
        assert _leading(first)  # undisturbed
        # the same URL after its process was killed (a restart): its lease runs out, and it leads
        first.kill(signal.SIGKILL)
        again = _serve(tmp_path, etcd, "again", TWIN_URL)
        procs.append(again)
        until(lambda: _leading(again), timeout_s=10, what="the restarted server leading")
    finally:
        for p in procs:
            p.kill()


def test_two_running_servers_with_one_advertise_url_never_both_coordinate(tmp_path: Path, etcd: EtcdCluster) -> None:
    other = _serve(tmp_path, etcd, "other", "http://10.9.9.8:8470")
    procs = [other]
    try:
        assert _leading(other)
        # both start while the leader key names another URL: nothing to refuse yet
        a, b = _serve(tmp_path, etcd, "a", TWIN_URL), _serve(tmp_path, etcd, "b", TWIN_URL)
        procs += [a, b]
        other.stop()  # a clean stop hands over at once: a and b both campaign
        both, leaders = 0, []
        end = time.monotonic() + 5.0  # more than twice the lease's TTL (2 s)
        while time.monotonic() < end:
            now = (_leading(a), _leading(b))
            both += all(now)
            if any(now):
                leaders.append(now.index(True))
            time.sleep(0.05)
        assert both == 0, f"a and b both coordinated in {both} samples"
        assert leaders and len(set(leaders)) == 1, f"the lead moved between a and b: {leaders}"
        follower = (a, b)[1 - leaders[0]]

        def errors() -> list[dict[str, str]]:
            lines = [json.loads(x) for x in follower.log().splitlines() if x.startswith("{")]
            return [e for e in lines if e["level"] == "error" and "--advertise-url" in e["msg"]]

        said = until(errors, timeout_s=10, what="the follower's error")
        assert TWIN_URL in said[0]["msg"] and "stays a follower" in said[0]["msg"], said
        time.sleep(1.0)
        assert len(errors()) == 1 and not _leading(follower)  # said once, not at every poll
    finally:
        for p in procs:
            p.kill()
