"""A worker's exit as its node daemon reports it (issue 39): a worker that ends cleanly (exit 0)
is no failure — not in ``/v1/cluster``'s failures, the job's ``worker_exits`` or ``ffplane
status``'s "recent failures" — while one that crashes is, as before. A real data server, a real
daemon and real worker processes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests._servers import TOKEN, Proc, until
from tests.trainer_client.test_jobs import _ffplane
from trainer_client.jobs import Jobs

REPO = Path(__file__).resolve().parents[2]
WORKER = """
import os, sys
from trainer_client import Checkpointer
ckpt = Checkpointer("ends", socket_path=sys.argv[1])
ckpt.save(0, {"w": 1})
ckpt.wait()
print(os.getpid(), flush=True)
if sys.argv[2] == "crash":
    raise RuntimeError("the training script's own bug")
"""


def _worker(socket: Path, how: str) -> int:
    """Run a worker that saves once and then ends (``clean``) or raises (``crash``): its pid."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FFPLANE_")}
    r = subprocess.run([sys.executable, "-c", WORKER, str(socket), how], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert r.returncode == (0 if how == "clean" else 1), r.stderr[-2000:]
    return int(r.stdout.split()[0])


def test_a_worker_that_ends_cleanly_is_no_failure(dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    start_daemon()
    Jobs(dataserver.url, TOKEN).create("ends", dataset="tokens", dp=1, batch_per_rank=4, max_steps=10)
    until(lambda: httpx.get(dataserver.url + "/v1/nodes").json()["ring"], what="the daemon in the ring")

    def exits() -> list[dict[str, Any]]:
        exits: list[dict[str, Any]] = httpx.get(dataserver.url + "/v1/jobs/ends/status").json()["worker_exits"]
        return exits

    clean = _worker(shm_root / "daemon.sock", "clean")
    crashed = _worker(shm_root / "daemon.sock", "crash")
    # the daemon reports exits in the order they happen: once the crash is listed, a report of
    # the clean end would be too
    until(lambda: any(w["pid"] == crashed for w in exits()), what="the crashed worker's exit reported")
    assert [w["pid"] for w in exits()] == [crashed]
    failures = [f for f in httpx.get(dataserver.url + "/v1/cluster").json()["failures"] if f["kind"] == "worker exit"]
    assert len(failures) == 1 and failures[0]["job"] == "ends", failures
    status = _ffplane("status", dataserver=dataserver.url)
    assert status.returncode == 0, status.stderr
    table = status.stdout.split("recent failures", 1)[1]
    assert table.count("worker exit") == 1, status.stdout
    assert clean != crashed
