"""Run the test DDP job (``_ddp_worker``) across the nodes of a LocalCluster, as torchrun would:
one process per rank, placed on a node, reading through that node's daemon."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from ffplane_harness.local_cluster import LocalCluster
from tests._servers import TOKEN

REPO = Path(__file__).parents[2]


class DdpRun:
    """One launch of every rank; ``placement[rank]`` is the daemon index the rank runs beside."""

    def __init__(self, c: LocalCluster, out: Path, job: str, placement: list[int], steps: int) -> None:
        assert c.dataserver is not None
        self.out, self.placement = out, placement
        world = len(placement)
        net = c.net
        master = net.nodes[placement[0] + 1].addr if net else "127.0.0.1"
        port = random.randrange(20000, 60000)
        self.procs: list[subprocess.Popen[bytes]] = []
        for rank, node in enumerate(placement):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": master,
                "MASTER_PORT": str(port),
                "FFPLANE_DATASERVER": c.dataserver.url,
                "FFPLANE_TOKEN": TOKEN,
                "FFPLANE_DAEMON_SOCKET": str(c.socket(node)),
                "FFPLANE_TEST_GLOO_TIMEOUT_S": "90",
                "FFPLANE_TEST_COMPUTE_S": "0.15",
            }
            if net:
                env["GLOO_SOCKET_IFNAME"] = net.nodes[node + 1].iface
            argv = c.worker_argv(node, [sys.executable, "-m", "tests.trainer_client._ddp_worker", job, str(out), str(steps)])
            with open(out / f"worker-{rank}.log", "ab") as log:
                self.procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))

    def on(self, node: int) -> list[subprocess.Popen[bytes]]:
        return [p for p, n in zip(self.procs, self.placement) if n == node]

    def progress(self) -> int:
        """The lowest step every rank has finished (-1 before the first)."""
        return min(last_step(self.out, r) for r in range(len(self.procs)))

    def wait_progress(self, step: int, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while self.progress() < step:
            if any(p.poll() is not None for p in self.procs) or time.monotonic() > deadline:
                raise AssertionError(f"ranks stopped before step {step}:\n{self.logs()}")
            time.sleep(0.02)

    def kill(self, procs: list[subprocess.Popen[bytes]] | None = None) -> None:
        for p in self.procs if procs is None else procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait()

    def wait(self, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            code = p.wait(timeout=max(1, deadline - time.monotonic()))
            assert code == 0, self.logs()

    def logs(self) -> str:
        return "\n".join(
            f"--- rank {r}\n" + (self.out / f"worker-{r}.log").read_text(errors="replace")[-2000:] for r in range(len(self.procs))
        )


def last_step(out: Path, rank: int) -> int:
    path = out / f"losses-{rank}.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    return int(lines[-1].split()[0]) if lines else -1


def losses(out: Path, rank: int) -> dict[int, str]:
    """Each step's loss as written by ``rank``; a step run again after a restore must have
    written the same loss both times."""
    seen: dict[int, str] = {}
    for line in (out / f"losses-{rank}.txt").read_text().splitlines():
        step, value = line.split()
        assert seen.setdefault(int(step), value) == value, f"rank {rank} step {step}: loss {value} after {seen[int(step)]}"
    return seen
