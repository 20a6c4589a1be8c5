"""Every benchmark runs at a tiny size, so none of them rots between measurement runs."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from bench import data_path

# Own step in .ci/run (-m bench): these check a benchmark still runs, not a feature.
pytestmark = pytest.mark.bench


def test_data_path_smoke(tmp_path: Path) -> None:
    # its daemons' sockets go under --work: a short folder, as a Unix socket's path holds 107 bytes
    work = Path(tempfile.mkdtemp(prefix="ffdp-"))
    try:
        out = _data_path(work, tmp_path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    saved = json.loads((tmp_path / "dp.json").read_text())
    for name in (
        "memcpy_gbps",
        "loopback_tcp_gbps",
        "http_stack_gbps",
        "end_to_end_bound_gbps",
        "node_cache_read_gbps",
        "end_to_end_gbps",
        "torch_dataloader_local_gbps",
    ):
        assert saved["figures"][name]["median"] > 0, name
    assert set(out["targets"]) >= {"node_cache_read_vs_memcpy", "end_to_end_vs_loopback_tcp"}
    if os.geteuid() == 0:  # it could mount the huge-page tmpfs, so it also measured /dev/shm
        assert saved["config"]["shm_pages"].startswith("2 MiB")
        assert saved["figures"]["node_cache_read_4k_pages_gbps"]["median"] > 0


def _data_path(work: Path, results: Path) -> dict[str, Any]:
    out: dict[str, Any] = data_path.main(
        [
            "--gib",
            "0.02",
            "--batch",
            "32",
            "--seq",
            "256",
            "--steps",
            "6",
            "--cached-steps",
            "4",
            "--repeats",
            "1",
            "--no-mosaic",
            "--work",
            str(work),
            "--results-dir",
            str(results),
            "--out",
            "dp",
        ]
    )
    return out


def test_checkpoint_smoke(tmp_path: Path) -> None:
    from bench import checkpoint

    out = checkpoint.main(["--sizes-mb", "4", "--repeats", "1", "--no-dlrover", "--results-dir", str(tmp_path), "--out", "ck"])
    fig = out["figures"]["4MiB"]
    for name in (
        "save_block_s",
        "memcpy_s",
        "torch_save_shm_s",
        "torch_save_disk_s",
        "dcp_async_save_block_s",
        "restore_s",
        "torch_load_shm_s",
    ):
        assert fig[name]["median"] > 0, name
    assert (tmp_path / "ck.json").exists()


def test_peers_smoke(tmp_path: Path) -> None:
    """ffplane beside the plain saver and every peer that is installed (bench/setup_peers.sh):
    a peer that is not keeps its row, with the reason."""
    from bench import peers

    systems = "none,ffplane,ffplane_dcp,torch_save_shm,dlrover,nvrx,mlflashpoint"
    out = peers.main(["--smoke", "--states", "fsdp2", "--systems", systems, "--results-dir", str(tmp_path), "--out", "pe"])
    table = out["figures"]["fsdp2"]
    for name in ("ffplane", "ffplane_dcp"):
        row = table[name]
        assert row["block_s"]["median"] > 0 and row["restore_s"]["median"] > 0, name
        assert all(row["verified"]) and row["replica_after_s"] is not None, name
        assert row["integrity"].startswith("detected, routed around"), (name, row["integrity"])
    assert table["torch_save_shm"]["integrity"].startswith("NOT detected")  # a flipped byte goes through torch.load
    for peer in ("dlrover", "nvrx", "mlflashpoint"):
        assert "unavailable" in table[peer] or table[peer]["block_s"]["median"] > 0, peer
    targets = out["targets"]
    for key in ("save_vs_best_peer", "restore_vs_best_peer", "dcp_save_vs_checkpointer_save"):
        assert targets[key]["ratio"] > 0, key
    assert "memory_vs_best_replicating_peer" in targets  # None where no replicating peer is installed
    assert (tmp_path / "pe.json").exists()


def test_overhead_smoke(tmp_path: Path) -> None:
    from bench import overhead

    out = overhead.main(["--rounds", "1", "--steps", "1", "--batch", "32", "--results-dir", str(tmp_path), "--out", "oh"])
    assert out["targets"]["overhead_ratio"]["ratio"] > 0


def test_coordinator_scale_smoke(tmp_path: Path) -> None:
    from bench import coordinator_scale

    out = coordinator_scale.main(["--nodes", "16", "--rounds", "1", "--repeats", "1", "--results-dir", str(tmp_path), "--out", "cs"])
    assert out["figures"]["detect_dead_s"]["median"] > 0 and out["figures"]["cpu_per_round_s"]["median"] > 0


def _needs_netns() -> None:
    import pytest

    from ffplane_harness.netns import available

    why = available()
    if why:
        pytest.skip(why)


def test_replication_smoke(tmp_path: Path) -> None:
    _needs_netns()
    from bench import replication

    out = replication.main(["--mb", "4", "--repeats", "1", "--results-dir", str(tmp_path), "--out", "rp"])
    for name in ("raw_tcp_gbps", "replication_gbps", "remote_restore_gbps"):
        assert out["figures"][name]["median"] > 0, name


def test_link_gate_smoke(tmp_path: Path) -> None:
    _needs_netns()
    from bench import link_gate

    out = link_gate.main(
        ["--bursts", "2", "--burst-mb", "2", "--state-mb", "4", "--repeats", "1", "--results-dir", str(tmp_path), "--out", "lg"]
    )
    # a 0.2 s TRAIN window may see no STATE chunk at all: the smoke checks the figures exist, not their size
    assert out["figures"]["train_alone_s"]["median"] > 0 and {"state_bytes_ungated", "gated_idle_capacity_used"} <= set(out["figures"])
    assert (tmp_path / "lg.json").exists()


@pytest.mark.slow  # ~2.5 min; the demo, node-loss and soak tests recover the same failures in the default run
def test_recovery_smoke(tmp_path: Path) -> None:
    """Both sides of bench/recovery.py start, fail, recover and are timed (one of each failure)."""
    from bench import recovery

    out = recovery.main(
        ["--repeats", "1", "--goodput-failures", "1", "--goodput-interval", "10", "--k", "10", "--results-dir", str(tmp_path)]
    )
    assert set(out["figures"]) == {"ffplane", "torch.save K=10"}
    for side in out["figures"].values():
        for kind in ("worker SIGKILL", "node loss"):
            assert set(side[kind]["stages_median_s"]) >= {"restarted", "restored", "first_step", "caught_up"}
        assert side["goodput"]["goodput"] > 0
    assert out["figures"]["ffplane"]["node loss"]["steps_lost"]["max"] <= 1
    assert (tmp_path / "recovery.json").exists()


def test_step_cost_smoke(tmp_path: Path) -> None:
    """bench/step_cost.py runs the plain job, its floor (with a sink process), the shipped one and,
    with --together, a daemons' variant on a second cluster up beside the first, paired with plain."""
    from bench import step_cost

    variants = ("plain", "floor", "ffplane", "no_replica_wait")
    out = step_cost.main(
        ["--steps", "20", "--repeats", "1", "--together", "--variants", ",".join(variants), "--results-dir", str(tmp_path)]
    )
    assert all(out["figures"][f"steps_per_min_{v}"]["median"] > 0 for v in variants)
    assert set(out["targets"]) == {
        "floor_vs_plain",
        "ffplane_vs_plain",
        "no_replica_wait_vs_plain",
        "ffplane_vs_floor",
        "same_repeat_ffplane_vs_plain",
    }
    assert out["targets"]["same_repeat_ffplane_vs_plain"]["target"] == ">= 0.8"  # the judged figure
    assert {k for k in out["figures"] if k.startswith("same_repeat_")} == {
        "same_repeat_floor_vs_plain",
        "same_repeat_ffplane_vs_plain",
        "same_repeat_no_replica_wait_vs_plain",
        "same_repeat_ffplane_vs_floor",
        "same_repeat_no_replica_wait_vs_ffplane",
    }


def test_step_cost_pairs_only_variants_that_ran_back_to_back_and_pools_files(tmp_path: Path) -> None:
    """A daemon variant (its own cluster, after the others) gets no same-repeat ratio unless the run
    kept every cluster up (--together); --pool reads result files and pools their repeats."""
    from bench import step_cost

    samples = {"plain": [100.0, 50.0], "floor": [90.0, 45.0], "ffplane": [80.0, 45.0], "no_replicate": [10.0, 10.0]}
    got = step_cost.same_repeat(samples, ["plain", "floor", "ffplane"])
    assert set(got) == {"same_repeat_floor_vs_plain", "same_repeat_ffplane_vs_plain", "same_repeat_ffplane_vs_floor"}
    assert got["same_repeat_ffplane_vs_plain"]["samples"] == [0.8, 0.9]
    files = []
    for i in range(2):
        figures = {f"steps_per_min_{v}": {"samples": s} for v, s in samples.items()}
        files.append(tmp_path / f"run{i}.json")
        files[-1].write_text(json.dumps({"figures": figures}))
    pooled = step_cost.main(["--pool", *map(str, files)])["figures"]
    assert pooled["same_repeat_ffplane_vs_floor"]["samples"] == [80 / 90, 1.0, 80 / 90, 1.0]
    lo, hi = pooled["same_repeat_ffplane_vs_floor"]["ci90"]  # the median's bootstrap interval, within the samples
    assert 80 / 90 <= lo <= hi <= 1.0 and lo < hi
    assert not any("no_replicate" in k for k in pooled)
    # a run with --together kept the daemons' clusters up and rotated them into every repeat: they pair
    files[1].write_text(json.dumps({"figures": json.loads(files[1].read_text())["figures"], "config": {"together": True}}))
    pooled = step_cost.main(["--pool", *map(str, files)])["figures"]
    assert pooled["same_repeat_no_replicate_vs_plain"]["samples"] == [0.1, 0.2]
    assert pooled["same_repeat_no_replicate_vs_ffplane"]["samples"] == [10 / 80, 10 / 45]


# a small dataset and few steps, for the benchmarks that walk the data path
_SMALL_PATH = "--gib 0.02 --batch 32 --seq 256 --steps 8 --repeats 1 --huge off".split()


def test_reader_steps_smoke(tmp_path: Path) -> None:
    from bench import reader_steps

    out = reader_steps.main([*_SMALL_PATH, "--work", str(tmp_path / "data"), "--results-dir", str(tmp_path), "--out", "rs"])
    assert out["figures"]["copy_step_ms"]["median"] > 0
    assert 0 <= out["figures"]["copy_ahead_fraction"]["median"] <= 1


def test_save_cpu_smoke(tmp_path: Path) -> None:
    from bench import save_cpu

    out = save_cpu.main(
        ["--cases", "cnn,fsdp2,8", "--saves", "10", "--fsdp2-saves", "3", "--repeats", "1", "--gap-ms", "1"]
        + ["--results-dir", str(tmp_path), "--out", "sc"]
    )
    f = out["figures"]
    assert f["fsdp2_save_ms"]["median"] > 0 and out["targets"]["fsdp2_total_vs_floor"]["ratio"] > 0
    assert f["cnn_total_ms"]["median"] > 0 and f["cnn_floor_ms"]["median"] > 0 and f["cnn_receiver_ms"]["median"] > 0
    assert f["8mib_total_s_per_gib"]["median"] > 0 and f["8mib_floor_s_per_gib"]["median"] > 0
    assert f["round_trip_us"]["median"] > 0 and out["targets"]["round_trip_vs_floor"]["ratio"] > 0


def test_path_cpu_smoke(tmp_path: Path) -> None:
    from bench import path_cpu

    out = path_cpu.main([*_SMALL_PATH, "--work", str(tmp_path / "data"), "--results-dir", str(tmp_path), "--out", "pc"])
    f = out["figures"]
    assert f["dataserver_ms"]["median"] > 0 and f["daemon_ms"]["median"] > 0 and f["stack_ms"]["median"] > 0
    assert abs(f["total_ms"]["median"] - sum(f[k]["median"] for k in ("dataserver_ms", "daemon_ms", "reader_ms"))) < 1e-6


def test_gpu_checkpoint_smoke_on_cpu(tmp_path: Path) -> None:
    from bench import gpu_checkpoint

    out = gpu_checkpoint.main(
        ["--device", "cpu", "--sizes-mb", "8", "--repeats", "1", "--steps", "1", "--huge", "off", "--results-dir", str(tmp_path)]
    )
    fig = out["figures"]["8MiB"]
    for name in ("bare_d2h_s", "bare_h2d_s", "save_block_s", "overlapped_save_block_s", "step_s", "step_overlapped_s"):
        assert fig[name]["median"] > 0, name
    assert set(out["targets"]["8MiB"]) == {
        "save_block_vs_bare_d2h",
        "overlapped_step_vs_plain",
        "torch_save_vs_save_block",
        "restore_vs_bare_h2d",
    }
    assert (tmp_path / "gpu_checkpoint_cpu.json").exists()


def test_dali_smoke(tmp_path: Path) -> None:
    import pytest

    pytest.importorskip("nvidia.dali", reason="the dali extra is not installed")
    from bench import dali

    out = dali.main(["--images", "128", "--batch", "32", "--repeats", "1", "--results-dir", str(tmp_path)])
    assert out["figures"]["cache_images_per_s"]["median"] > 0 and out["figures"]["reader_images_per_s"]["median"] > 0
    assert (tmp_path / "dali.json").exists()
