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


def _exports_whole(tmp_path: Path, sock: str, step: int, trained: dict[str, torch.Tensor]) -> None:
    """``ffplane export`` of the Checkpointer-saved step: the DCP directory stock ``dcp.load``
    reads and ``model.safetensors`` hold the whole tensors, assembled from every rank's part."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from trainer_client.export import export

    out = tmp_path / f"exported-{step}"
    export("fsdp2", step, out, socket_path=sock)
    model = load_file(out / "model.safetensors")
    assert sorted(model) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    for key, value in model.items():
        assert torch.equal(value, trained[f"/{key}"]), key
    want = {"model": {k: torch.empty_like(v) for k, v in model.items()}, "optim": {"state": {0: {"exp_avg": torch.empty(40, 24)}}}}
    dcp.load(want, checkpoint_id=str(out), no_dist=True)
    assert all(torch.equal(v, trained[f"/{k}"]) for k, v in want["model"].items())
    assert torch.equal(want["optim"]["state"][0]["exp_avg"], trained["/0/exp_avg"])


def test_fsdp2_state_restores_bitwise_into_the_live_shards_and_onto_the_mesh(
    tmp_path: Path, start_daemon: Callable[..., Proc], shm_root: Path
) -> None:
    start_daemon()
    sock = str(shm_root / "daemon.sock")
    torchrun(tmp_path, _WORKER, "train", sock, str(tmp_path / "trained.pt"), "4")
    torchrun(tmp_path, _WORKER, "restore", sock, str(tmp_path / "restored.pt"))
    trained = torch.load(tmp_path / "trained.pt")
    trained.pop("local_bytes")
    restored = torch.load(tmp_path / "restored.pt")
    assert restored["step"] == 4
    assert set(restored["into"]) == set(trained) and any("exp_avg" in k for k in trained)
    for key, value in trained.items():
        assert torch.equal(restored["into"][key], value), key  # before: save() raised on the DTensors
    for key, value in restored["mesh"].items():
        assert torch.equal(value, trained[key]), key
    _exports_whole(tmp_path, sock, 4, trained)


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
    trained.pop("local_bytes")
    restored = torch.load(tmp_path / "restored.pt")
    assert restored["step"] == 3 and any("exp_avg" in k for k in trained)
    for key, value in trained.items():
        assert torch.equal(restored["into"][key], value), key
    assert set(restored["mesh"]) == {"/0.weight", "/0.bias", "/2.weight", "/2.bias"}
    for key, value in restored["mesh"].items():
        assert torch.equal(value, trained[key]), key
    _exports_whole(tmp_path, sock, 3, trained)  # _StridedShard parts placed by their mesh coordinates
    # DCP: saved on the 2-D mesh by 4 ranks, loaded by 2 ranks of plain FSDP2 (resharded)
    dcp_worker = "tests.trainer_client._dcp_worker"
    torchrun(tmp_path, dcp_worker, "save", sock, str(tmp_path / "dcp-saved.pt"), "2", "tp=2", nproc=4)
    torchrun(tmp_path, dcp_worker, "load", sock, str(tmp_path / "dcp-loaded.pt"), nproc=2)
    saved, loaded = torch.load(tmp_path / "dcp-saved.pt"), torch.load(tmp_path / "dcp-loaded.pt")
    assert loaded["step"] == 2 and set(saved["full"]) == set(loaded["full"])
    for key, value in saved["full"].items():
        assert torch.equal(loaded["full"][key], value), key


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
    torchrun(tmp_path, _WORKER, "train", sock, str(tmp_path / "trained.pt"), "3", "replicate=2", nproc=4)
    torchrun(tmp_path, _WORKER, "restore", sock, str(tmp_path / "restored.pt"), "replicate=2", nproc=4)
    trained = torch.load(tmp_path / "trained.pt")
    local_bytes = int(trained.pop("local_bytes"))
    restored = torch.load(tmp_path / "restored.pt")
    assert restored["step"] == 3
    for key, value in trained.items():
        assert torch.equal(restored["into"][key], value), key
    for key, value in restored["mesh"].items():
        assert torch.equal(value, trained[key]), key
    _exports_whole(tmp_path, sock, 3, trained)
    with urllib.request.urlopen(f"{daemon.url}/v1/state", timeout=10) as resp:
        roles = [r for r in json.loads(resp.read())["roles"] if r["job"] == "fsdp2"]
    assert sorted(r["role"] for r in roles) == ["dp0-pp0-tp0", "dp0-pp0-tp1", "dp1-pp0-tp0", "dp1-pp0-tp1"]
    saved = sum(next(v for v in r["versions"] if v["step"] == 3)["nbytes"] for r in roles)
    # the four ranks' local parts once over (plus 64-byte alignment per storage), not twice
    assert local_bytes // 2 <= saved < local_bytes * 0.75, (saved, local_bytes)
