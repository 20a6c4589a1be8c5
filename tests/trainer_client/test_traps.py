"""What a new user adapting a real training script meets (issue 17): mixed precision with a
GradScaler under autocast resumes exactly, and a worker with no daemon is told what to do."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._servers import Proc
from trainer_client import Checkpointer, TransportError


def _amp_job() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)  # its scale grows every 2 steps
    return model, opt, scaler


def _amp_step(model: torch.nn.Module, opt: torch.optim.Optimizer, scaler: Any, step: int) -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().square().mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def test_a_grad_scaler_and_autocast_job_resumes_bitwise_with_the_scalers_state(start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    start_daemon()
    sock = shm_root / "daemon.sock"
    model, opt, scaler = _amp_job()
    for step in range(6):  # the failure-free run
        _amp_step(model, opt, scaler, step)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    model, opt, scaler = _amp_job()
    ckpt = Checkpointer("amp", socket_path=sock)
    for step in range(3):
        _amp_step(model, opt, scaler, step)
        ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict(), "scaler": scaler})  # a Stateful leaf
    ckpt.close()
    saved_scale = scaler.get_scale()

    model, opt, scaler = _amp_job()  # the restarted worker
    ckpt = Checkpointer("amp", socket_path=sock)
    restored = ckpt.restore(into={"model": model.state_dict(), "optim": opt.state_dict(), "scaler": scaler})
    assert restored is not None and restored.step == 2
    assert scaler.get_scale() == saved_scale != 2.0**10  # loaded by the scaler's load_state_dict
    opt.load_state_dict(restored.state["optim"])
    for step in range(3, 6):
        _amp_step(model, opt, scaler, step)
    ckpt.close()
    for key, value in expected.items():
        assert torch.equal(model.state_dict()[key], value), key


def test_a_worker_without_a_daemon_is_told_how_to_start_one(tmp_path: Path) -> None:
    with pytest.raises(TransportError, match=r"no statestore daemon at .*Start one on this node \(statestore serve --root"):
        Checkpointer("alone", socket_path=tmp_path / "daemon.sock").restore()


def test_a_checkpointer_of_another_shape_is_told_to_reshard_through_dcp(start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    """A dp 4 job's step, restored by a dp 2 job: before, the razored pieces of two missing peers
    read as corrupt copies and the job fell back older; now it names both shapes."""
    from trainer_client import Layout
    from trainer_client._restore import LayoutError

    start_daemon()
    sock = shm_root / "daemon.sock"
    four = [Checkpointer("shape", Layout(dp=4, dp_rank=r), socket_path=sock) for r in range(4)]
    for ck in four:
        ck.save(1, {"w": torch.arange(64, dtype=torch.float32)})
    for ck in four:
        ck.close()
    two = Checkpointer("shape", Layout(dp=2, dp_rank=0), socket_path=sock)
    with pytest.raises(LayoutError, match=r"saved by a job of shape \{'dp': 4, 'pp': 1, 'tp': 1\}, this one is \{'dp': 2"):
        two.restore()
    two.close()


def test_a_step_outside_the_shared_range_is_refused_at_save_and_changes_nothing(start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    """A step the coordinator could not take (2**60 > 2**53) once went through the client and the
    daemon, and then had the node's heartbeats refused for good. Now ``save`` refuses it, naming
    the range; the step before it stays the newest, and the daemon refuses it too if sent raw."""
    from ffplane_contract import control as proto
    from ffplane_contract.limits import MAX_STEP

    start_daemon()
    ck = Checkpointer("bigstep", socket_path=shm_root / "daemon.sock")
    try:
        ck.save(3, {"w": torch.ones(4)})
        for bad in (2**60, MAX_STEP + 1, -1):
            with pytest.raises(ValueError, match=r"0\.\.2\^53-1"):
                ck.save(bad, {"w": torch.zeros(4)})
        ck.save(MAX_STEP, {"w": torch.full((4,), 2.0)})  # the largest step is a step
        ck.wait()
    finally:
        ck.close()
    got = Checkpointer("bigstep", socket_path=shm_root / "daemon.sock").restore()
    assert got is not None and got.step == MAX_STEP and torch.equal(got.state["w"], torch.full((4,), 2.0))
    with pytest.raises(ValueError, match=r"0\.\.2\^53-1"):
        proto.decode_request(proto.encode(proto.Verify("bigstep", 2**60, [])))
