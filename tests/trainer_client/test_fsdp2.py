"""FSDP2 (``fully_shard``) state through the Checkpointer: each rank saves its shards of the
parameters and of the optimizer's moments (DTensors), and a restarted job gets them back bit for
bit, into its live sharded state or as DTensors on its mesh (issue 17)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests._servers import Proc
from tests.trainer_client._torchrun import torchrun

pytest.importorskip("torch.distributed.fsdp")
_WORKER = "tests.trainer_client._fsdp2_worker"


def test_fsdp2_state_restores_bitwise_into_the_live_shards_and_onto_the_mesh(
    tmp_path: Path, start_daemon: Callable[..., Proc], shm_root: Path
) -> None:
    start_daemon()
    sock = str(shm_root / "daemon.sock")
    torchrun(tmp_path, _WORKER, "train", sock, str(tmp_path / "trained.pt"), "4")
    torchrun(tmp_path, _WORKER, "restore", sock, str(tmp_path / "restored.pt"))
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
    log = torchrun(tmp_path, "tests.trainer_client._rank_state_worker", "replicated", sock)
    assert log.count("refused: ") == 2 and "['rng'] differ across the dp group" in log
    torchrun(tmp_path, "tests.trainer_client._rank_state_worker", "private", sock, str(tmp_path / "draws.json"))
    draws = json.loads((tmp_path / "draws.json").read_text())
    for rank in draws:  # after the restore every generator draws what it drew after the save
        assert rank[:4] == rank[4:]
    assert draws[0][:4] != draws[1][:4]  # and each rank got its own state back
