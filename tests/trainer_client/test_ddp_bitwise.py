"""Invariant 5: a DDP run with workers SIGKILLed and restarted ends bitwise-equal to one without."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests._servers import TOKEN, Proc
from tests.conftest import create_job
from tests.trainer_client._ddp_cluster import last_step, losses

STEPS = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(out: Path, job: str, dataserver: Proc, sock: Path) -> list[subprocess.Popen[bytes]]:
    """What torchrun does for one node: start every local worker with a fresh rendezvous port."""
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "FFPLANE_DATASERVER": dataserver.url,
            "FFPLANE_TOKEN": TOKEN,
            "FFPLANE_DAEMON_SOCKET": str(sock),
        }
        log = open(out / f"worker-{rank}.log", "ab")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.trainer_client._ddp_worker", job, str(out), str(STEPS)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=Path(__file__).parents[2],
            )
        )
    return procs


def _wait_all(procs: list[subprocess.Popen[bytes]], out: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        code = p.wait(timeout=max(1, deadline - time.monotonic()))
        assert code == 0, (out / "worker-0.log").read_text()[-3000:] + (out / "worker-1.log").read_text()[-3000:]


def test_ddp_with_sigkills_ends_bitwise_equal(tmp_path: Path, dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    start_daemon()
    sock = shm_root / "daemon.sock"
    create_job(dataserver, name="straight", max_steps=STEPS)
    create_job(dataserver, name="killed", max_steps=STEPS)
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir(), killed.mkdir()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs = _launch(straight, "straight", dataserver, sock)
        _wait_all(procs, straight)

        rng = random.Random(7)
        kill_at = sorted(rng.sample(range(3, STEPS - 3), 3))
        for target in kill_at:
            procs = _launch(killed, "killed", dataserver, sock)
            victim = rng.randrange(2)
            deadline = time.monotonic() + 120
            while last_step(killed, victim) < target and time.monotonic() < deadline:
                if any(p.poll() is not None for p in procs):
                    break
                time.sleep(0.005)
            os.kill(procs[victim].pid, signal.SIGKILL)
            for p in procs:  # torchrun restarts every local worker when one fails
                if p.poll() is None:
                    p.kill()
                p.wait()
        procs = _launch(killed, "killed", dataserver, sock)
        _wait_all(procs, killed)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    for rank in range(2):
        assert (killed / f"final-{rank}.txt").read_text() == (straight / f"final-{rank}.txt").read_text()
        assert losses(killed, rank) == losses(straight, rank)  # every step's loss, bit for bit
        assert sorted(losses(killed, rank)) == list(range(STEPS))
