"""`ffplane demo`, as a new user runs it: two nodes, a killed worker, a lost node; each failure's
timeline, at most one lost step, bitwise-equal weights, PNGs, and nothing left behind."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ffplane_harness.local_cluster import orphaned_roots

REPO = Path(__file__).parents[2]


def _left_behind() -> set[str]:
    """Local-cluster folders whose maker has exited: the demo's, once it is done, if it leaked any."""
    return {p.name for p in orphaned_roots()}


def test_the_demo_recovers_both_failures_bitwise_and_cleans_up(tmp_path: Path) -> None:
    before, work_before = _left_behind(), set(Path(tempfile.gettempdir()).glob("ffplane-demo-*"))
    out = tmp_path / "demo"
    r = subprocess.run(
        [sys.executable, "-m", "ffplane_harness.demo", "demo", "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((out / "demo.json").read_text())
    assert result["bitwise_equal"] is True
    assert [t["failure"] for t in result["timelines"]] == ["worker SIGKILL", "node loss"]
    for t in result["timelines"]:
        assert 0 <= t["steps_lost"] <= 1
        assert {"detected", "restarted", "restored", "data_ready", "first_step"} <= set(t["seconds"])
        assert t["seconds"]["restored"] <= t["seconds"]["data_ready"] <= t["seconds"]["first_step"]
    assert (out / "timeline.png").stat().st_size > 0 and (out / "loss.png").stat().st_size > 0
    assert "final weights bitwise-equal to the failure-free run: True" in r.stdout
    assert _left_behind() <= before  # every shared-memory folder it made is gone
    assert set(Path(tempfile.gettempdir()).glob("ffplane-demo-*")) == work_before  # its work folder too


# the Checkpointer's FSDP2 path under failures also runs in the soak (bench/soak.py --model fsdp2)
@pytest.mark.parametrize("model", [pytest.param("fsdp2", marks=pytest.mark.slow), "fsdp2-dcp"])
def test_the_fsdp2_gpt_recovers_a_worker_kill_and_a_node_loss_bitwise(tmp_path: Path, model: str) -> None:
    """The GPT sharded with ``fully_shard`` (each rank holds a quarter of the weights and
    moments): saved by the Checkpointer, or by ``dcp.save`` through DaemonWriter and loaded by
    ``dcp.load`` through DaemonReader — the replacement node's ranks read their shards from the
    neighbour's replicas. Before issue 17, the first save of the sharded state raised."""
    out = tmp_path / "demo"
    r = subprocess.run(
        [sys.executable, "-m", "ffplane_harness.demo", "demo", "--model", model, "--steps", "24", "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((out / "demo.json").read_text())
    assert result["model"] == model and result["bitwise_equal"] is True
    for t in result["timelines"]:
        assert 0 <= t["steps_lost"] <= 1 and t["restored_step"] >= 0
