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


def test_tensor_parallel_inside_fsdp2_on_a_2d_mesh_restores_bitwise_and_dcp_reshards_it_onto_1d(
    tmp_path: Path, start_daemon: Callable[..., Proc], shm_root: Path
) -> None:
    """A (dp=2, tp=2) mesh: column- then row-wise tensor parallel inside each dp group, FSDP2
    across them, so the first layer's shards are ``_StridedShard`` (FSDP2 splitting a tp shard).
    Before, ``save()`` refused that placement; a restore onto the mesh that read it as a plain
    ``Shard`` would have permuted the rows silently."""
    start_daemon()
    sock = str(shm_root / "daemon.sock")
    torchrun(tmp_path, _WORKER, "train", sock, str(tmp_path / "trained.pt"), "3", "tp=2", nproc=4)
    torchrun(tmp_path, _WORKER, "restore", sock, str(tmp_path / "restored.pt"), "tp=2", nproc=4)
    trained = torch.load(tmp_path / "trained.pt")
    restored = torch.load(tmp_path / "restored.pt")
    assert restored["step"] == 3 and any("exp_avg" in k for k in trained)
    for key, value in trained.items():
        assert torch.equal(restored["into"][key], value), key
    assert set(restored["mesh"]) == {"/0.weight", "/0.bias", "/2.weight", "/2.bias"}
    for key, value in restored["mesh"].items():
        assert torch.equal(value, trained[key]), key
    # DCP: saved on the 2-D mesh by 4 ranks, loaded by 2 ranks of plain FSDP2 (resharded)
    dcp_worker = "tests.trainer_client._dcp_worker"
    torchrun(tmp_path, dcp_worker, "save", sock, str(tmp_path / "dcp-saved.pt"), "2", "tp=2", nproc=4)
    torchrun(tmp_path, dcp_worker, "load", sock, str(tmp_path / "dcp-loaded.pt"), nproc=2)
    saved, loaded = torch.load(tmp_path / "dcp-saved.pt"), torch.load(tmp_path / "dcp-loaded.pt")
    assert loaded["step"] == 2 and set(saved["full"]) == set(loaded["full"])
    for key, value in saved["full"].items():
        assert torch.equal(loaded["full"][key], value), key
