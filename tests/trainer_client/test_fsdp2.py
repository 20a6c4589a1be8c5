"""FSDP2 (``fully_shard``) state through the Checkpointer: each rank saves its shards of the
parameters and of the optimizer's moments (DTensors), and a restarted job gets them back bit for
bit, into its live sharded state or as DTensors on its mesh (issue 17)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests._servers import Proc

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("torch.distributed.fsdp")


def _torchrun(tmp_path: Path, port: int, *args: str, module: str = "tests.trainer_client._fsdp2_worker") -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    log = tmp_path / f"torchrun-{args[0]}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
             "-m", module, *args],
            env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
        )  # fmt: skip
        try:
            rc = proc.wait(timeout=240)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    assert rc == 0, log.read_text()[-3000:]
    return log.read_text()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_fsdp2_state_restores_bitwise_into_the_live_shards_and_onto_the_mesh(
    tmp_path: Path, start_daemon: Callable[..., Proc], shm_root: Path
) -> None:
    start_daemon()
    sock = str(shm_root / "daemon.sock")
    _torchrun(tmp_path, _free_port(), "train", sock, str(tmp_path / "trained.pt"), "4")
    _torchrun(tmp_path, _free_port(), "restore", sock, str(tmp_path / "restored.pt"))
    trained = torch.load(tmp_path / "trained.pt")
    restored = torch.load(tmp_path / "restored.pt")
    assert restored["step"] == 4
    assert set(restored["into"]) == set(trained) and any("exp_avg" in k for k in trained)
    for key, value in trained.items():
        assert torch.equal(restored["into"][key], value), key  # before: save() raised on the DTensors
    for key, value in restored["mesh"].items():
        assert torch.equal(value, trained[key]), key


def test_per_rank_state_saved_as_replicated_is_refused_naming_the_key_and_rng_state_restores_per_rank(
    tmp_path: Path, start_daemon: Callable[..., Proc], shm_root: Path
) -> None:
    """nanoGPT seeds its RNG per rank; saved without private_keys it came back as another
    rank's, silently. Now the first save compares each key's bytes across the dp group."""
    import json

    start_daemon()
    sock = str(shm_root / "daemon.sock")
    log = _torchrun(tmp_path, _free_port(), "replicated", sock, module="tests.trainer_client._rank_state_worker")
    assert log.count("refused: ") == 2 and "['rng'] differ across the dp group" in log
    _torchrun(tmp_path, _free_port(), "private", sock, str(tmp_path / "draws.json"), module="tests.trainer_client._rank_state_worker")
    draws = json.loads((tmp_path / "draws.json").read_text())
    for rank in draws:  # after the restore every generator draws what it drew after the save
        assert rank[:4] == rank[4:]
    assert draws[0][:4] != draws[1][:4]  # and each rank got its own state back
