from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests._servers import Proc

KILLS = int(os.environ.get("KILLS", 50))


def _lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def _wait_for(pred: Callable[[], bool], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.002)


def test_worker_sigkilled_inside_save_always_restores_the_last_committed_step(
    tmp_path: Path, start_daemon: Callable[..., Proc], shm_root: Path
) -> None:
    start_daemon()
    log = tmp_path / "saves.log"
    zygote = subprocess.Popen(
        [sys.executable, "-m", "tests.trainer_client._save_zygote", str(shm_root / "daemon.sock"), str(log)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    rng = random.Random(1234)
    children: list[int] = []
    try:
        assert zygote.stdin is not None and zygote.stdout is not None
        for kill in range(KILLS + 1):
            seen = len(_lines(log))
            zygote.stdin.write("fork\n")
            zygote.stdin.flush()
            pid = int(zygote.stdout.readline())
            children.append(pid)
            # the new worker restored and committed at least once: it is in its save loop
            _wait_for(lambda: any(line.startswith("committed") for line in _lines(log)[seen:]))
            if kill == KILLS:
                break
            time.sleep(rng.uniform(0, 0.03))  # somewhere in begin / copy / commit / wait
            os.kill(pid, signal.SIGKILL)
            _wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 10)
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        zygote.kill()
        zygote.wait()

    lines = _lines(log)
    restores = [i for i, line in enumerate(lines) if line.startswith("restored")]
    assert len(restores) == KILLS + 1
    assert all(lines[i].endswith(" ok") for i in restores), [lines[i] for i in restores if not lines[i].endswith(" ok")]
    interrupted_saves = 0
    for prev, cur in zip(restores, restores[1:]):
        before = lines[prev + 1 : cur]
        committed = max(int(line.split()[1]) for line in before if line.startswith("committed"))
        started = max(int(line.split()[1]) for line in before if line.startswith("saving"))
        interrupted_saves += started > committed
        step = int(lines[cur].split()[1])
        # nothing committed is lost, and nothing half-written is restored
        assert committed <= step <= started, (committed, step, started)
    assert interrupted_saves >= KILLS // 2  # most kills really landed inside a save
