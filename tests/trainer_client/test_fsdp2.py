"""FSDP2 (``fully_shard``) state through the Checkpointer: each rank saves its shards of the
parameters and of the optimizer's moments (DTensors), and a restarted job gets them back bit for
bit, into its live sharded state or as DTensors on its mesh (issue 17)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests._servers import Proc
from tests.trainer_client._torchrun import assert_bitwise, torchrun

pytest.importorskip("torch.distributed.fsdp")
_WORKER = "tests.trainer_client._fsdp2_worker"


def _exports_whole(tmp_path: Path, sock: str, step: int, trained: dict[str, torch.Tensor]) -> None:
    """``ffplane export`` of the Checkpointer-saved step: the DCP directory stock ``dcp.load``
    reads and ``model.safetensors`` hold the whole tensors, assembled from every rank's part."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from trainer_client.export import export

    out = tmp_path / f"exported-{step}"
    export("fsdp2", step, out, socket_path=sock)
    model = load_file(out / "model.safetensors")
    assert_bitwise({k: trained[f"/{k}"] for k in ("0.weight", "0.bias", "2.weight", "2.bias")}, model)
    want = {"model": {k: torch.empty_like(v) for k, v in model.items()}, "optim": {"state": {0: {"exp_avg": torch.empty(40, 24)}}}}
    dcp.load(want, checkpoint_id=str(out), no_dist=True)
    assert_bitwise(model, want["model"])
    assert torch.equal(want["optim"]["state"][0]["exp_avg"], trained["/0/exp_avg"])


def _train_restore_export(tmp_path: Path, sock: str, steps: int, *shape: str, nproc: int = 2) -> int:
    """Train ``steps`` steps saving each, restore the newest twice (into the live shards, onto
    the mesh) and export it: each bitwise the trained state. The ranks' local bytes."""
    torchrun(tmp_path, _WORKER, "train", sock, str(tmp_path / "trained.pt"), str(steps), *shape, nproc=nproc)
    torchrun(tmp_path, _WORKER, "restore", sock, str(tmp_path / "restored.pt"), *shape, nproc=nproc)
    trained = torch.load(tmp_path / "trained.pt")
    local_bytes = int(trained.pop("local_bytes"))
    restored = torch.load(tmp_path / "restored.pt")
    assert restored["step"] == steps and any("exp_avg" in k for k in trained)
    assert restored["mesh_devices"] == ["cuda" if "cuda=1" in shape else "cpu"]
    assert_bitwise(trained, restored["into"])
    assert_bitwise({k: trained[k] for k in ("/0.weight", "/0.bias", "/2.weight", "/2.bias")}, restored["mesh"])
    _exports_whole(tmp_path, sock, steps, trained)
    return local_bytes


def test_fsdp2_state_restores_bitwise_into_the_live_shards_and_onto_the_mesh(
    tmp_path: Path, start_daemon: Callable[..., Proc], shm_root: Path
) -> None:
    start_daemon()
    _train_restore_export(tmp_path, str(shm_root / "daemon.sock"), 4)  # before: save() raised on the DTensors


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fsdp2_on_gpus_over_nccl_restores_bitwise_into_the_live_shards_and_onto_the_mesh(
    tmp_path: Path, start_daemon: Callable[..., Proc], shm_root: Path
) -> None:
    """The same job with its shards on the GPUs (one rank per GPU, NCCL): saved from device
    memory, restored into the live CUDA DTensors and as new DTensors on the CUDA mesh."""
    start_daemon()
    _train_restore_export(tmp_path, str(shm_root / "daemon.sock"), 4, "cuda=1", nproc=torch.cuda.device_count())


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
    _train_restore_export(tmp_path, sock, 3, "tp=2", nproc=4)  # export places _StridedShard parts by mesh coordinate
    # DCP: saved on the 2-D mesh by 4 ranks, loaded by 2 ranks of plain FSDP2 (resharded)
    dcp_worker = "tests.trainer_client._dcp_worker"
    torchrun(tmp_path, dcp_worker, "save", sock, str(tmp_path / "dcp-saved.pt"), "2", "tp=2", nproc=4)
    torchrun(tmp_path, dcp_worker, "load", sock, str(tmp_path / "dcp-loaded.pt"), nproc=2)
    saved, loaded = torch.load(tmp_path / "dcp-saved.pt"), torch.load(tmp_path / "dcp-loaded.pt")
    assert loaded["step"] == 2
    assert_bitwise(saved["full"], loaded["full"])


def test_hsdp_saves_each_replica_groups_shards_once_split_over_the_replicas_and_restores_bitwise(
    tmp_path: Path, start_daemon: Callable[..., Proc], shm_root: Path
) -> None:
    """HSDP on a (dp_replicate=2, dp_shard=2) mesh: each FSDP shard (placements Replicate,
    Shard) is held by both replica groups. The layout from the mesh makes dp_replicate the dp
    group, so each of the two holders saves half of it — before, both saved it whole."""
    import json
    import urllib.request

    daemon = start_daemon()
    sock = str(shm_root / "daemon.sock")
    local_bytes = _train_restore_export(tmp_path, sock, 3, "replicate=2", nproc=4)
    with urllib.request.urlopen(f"{daemon.url}/v1/state", timeout=10) as resp:
        roles = [r for r in json.loads(resp.read())["roles"] if r["job"] == "fsdp2"]
    assert sorted(r["role"] for r in roles) == ["dp0-pp0-tp0", "dp0-pp0-tp1", "dp1-pp0-tp0", "dp1-pp0-tp1"]
    saved = sum(next(v for v in r["versions"] if v["step"] == 3)["nbytes"] for r in roles)
    # the four ranks' local parts once over (plus 64-byte alignment per storage), not twice
    assert local_bytes // 2 <= saved < local_bytes * 0.75, (saved, local_bytes)
