"""Run a test worker module under torchrun on this machine (CPU/gloo), ended by the test, and
compare what its ranks wrote."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(tmp_path: Path, module: str, *args: str, nproc: int = 2, timeout_s: float = 240) -> str:
    """Run ``module`` on ``nproc`` ranks; its log (the test fails with its tail when a rank fails)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    log = tmp_path / f"torchrun-{module.rsplit('.', 1)[-1]}-{args[0]}-{nproc}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
             "-m", module, *args],
            env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
        )  # fmt: skip
        try:
            rc = proc.wait(timeout=timeout_s)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    assert rc == 0, log.read_text()[-3000:]
    return log.read_text()


def assert_bitwise(expected: dict[str, Any], got: dict[str, Any]) -> None:
    """Same keys, every tensor equal bit for bit (the key named on the first that differs)."""
    import torch

    assert set(got) == set(expected), sorted(set(got) ^ set(expected))
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def exit_worker() -> None:
    """End a torchrun test worker whose ranks all finished (process group destroyed, results
    written) without interpreter finalization: there gloo's threads sometimes abort the process
    ("terminate called without an active exception", SIGABRT; pytorch/pytorch#179291), which
    failed a test whose every rank had done its work (2 of ~6 runs of the FSDP2/DCP tests)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
