"""Saves and restores on the GPU path: the overlapped mode (its copy runs during the next forward
and backward, the optimizer step waits for it), CUDA state copied device → slot and slot →
device, pinned views. The CPU runs the same code paths (the overlapped copy on a thread, the
pinned registration a no-op); the CUDA tests are marked and skipped without a device."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests._servers import Proc, until
from trainer_client import Checkpointer, Layout

cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _snapshot(node: Any) -> Any:
    if isinstance(node, torch.Tensor):
        return node.detach().cpu().clone()
    if isinstance(node, dict):
        return {k: _snapshot(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_snapshot(v) for v in node)
    return node


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _train(device: str, steps: int, ckpt_of: Callable[[torch.optim.Optimizer], Checkpointer]) -> tuple[Any, Checkpointer]:
    """A small model trained ``steps`` steps with a save after each; the last saved state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = ckpt_of(opt)
    saved = None
    for step in range(steps):
        x = torch.randn(64, 512, device=device)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()  # an overlapped save of the previous step is waited for here
        if ckpt.overlapped:
            assert ckpt._in_flight is None  # the step's pre-hook finished the copy and handed the commit on
        opt.zero_grad()
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
        saved = _snapshot(state)
        assert ckpt.save(step, state)
        if ckpt.overlapped:
            assert ckpt._in_flight is not None  # queued, not done: the copy overlaps the next step
    return saved, ckpt


def test_overlapped_saves_wait_for_the_optimizer_step_and_restore_bitwise(start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    start_daemon()
    sock = shm_root / "daemon.sock"
    saved, ckpt = _train("cpu", 6, lambda opt: Checkpointer("ov", socket_path=sock, overlap_with=opt))
    ckpt.close()
    got = Checkpointer("ov", socket_path=sock).restore()
    assert got is not None and got.step == 5
    assert _equal(got.state, saved)


def test_an_overlapped_save_is_committed_without_waiting_for_the_next_step(start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    daemon = start_daemon()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1000))], lr=0.1)
    ckpt = Checkpointer("ov", socket_path=shm_root / "daemon.sock", overlap_with=[opt])
    state = {"w": torch.arange(1_000_000, dtype=torch.float32)}
    ckpt.save(7, state)
    # no optimizer step, no wait(): the commit goes to the daemon when the copy completes
    until(
        lambda: [v["step"] for r in httpx.get(daemon.url + "/v1/state").json()["roles"] for v in r["versions"]] == [7],
        what="step 7 committed",
    )
    ckpt.close()
    got = Checkpointer("ov", socket_path=shm_root / "daemon.sock").restore()
    assert got is not None and torch.equal(got.state["w"], state["w"])


def test_a_closed_checkpointer_leaves_the_optimizer_alone(start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    start_daemon()
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    ckpt = Checkpointer("ov", socket_path=shm_root / "daemon.sock", overlap_with=opt)
    ckpt.save(0, {"p": p})
    ckpt.close()
    assert not opt._optimizer_step_pre_hooks  # the hook went with it
    p.grad = torch.ones(4)
    opt.step()


def test_overlap_with_takes_optimizers_only(shm_root: Path) -> None:
    with pytest.raises(TypeError, match="overlap_with takes torch.optim.Optimizer"):
        Checkpointer("ov", socket_path=shm_root / "daemon.sock", overlap_with=[torch.nn.Linear(2, 2)])  # type: ignore[list-item]


def test_a_shard_mapped_for_device_copies_is_shared_and_read_only(tmp_path: Path) -> None:
    """What a CUDA restore page-locks must not be a writable private mapping: Linux copies
    every page of one when it is pinned long-term (0.8 s a GiB on an H100 host), and on a
    huge-page tmpfs the pin never returned. Without a pin the mapping stays private (a caller's
    in-place change cannot reach the daemon's file)."""
    from ffplane_contract.errors import CorruptError
    from trainer_client._restore import map_shard

    path = tmp_path / "shard"
    path.write_bytes(bytes(range(256)) * 64)
    shard = {"path": str(path), "offset": 256, "nbytes": 1024}

    def perms(t: torch.Tensor) -> str:
        for line in Path("/proc/self/maps").read_text().splitlines():
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= t.data_ptr() < hi:
                return line.split()[1]
        raise AssertionError("mapping not found")

    pinned = map_shard(shard, pins=[])
    assert perms(pinned) == "r--s" and pinned[0].item() == 0 and len(pinned) == 1024
    private = map_shard(shard)
    assert perms(private) == "rw-p"
    private[0] = 7  # copy-on-write: the file keeps its byte
    assert path.read_bytes()[256] == 0
    pins: list[Any] = []
    with pytest.raises(CorruptError, match="shorter than its header says"):
        map_shard({**shard, "nbytes": 1 << 20}, pins)
    assert pins == []  # refused before the pin: the caller's release never runs on this path


def test_state_on_another_device_is_refused_by_name(start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    from trainer_client import StateError

    start_daemon()
    ckpt = Checkpointer("meta", socket_path=shm_root / "daemon.sock")
    with pytest.raises(StateError, match=r"\['w'\] is on meta"):
        ckpt.save(0, {"w": torch.empty(4, device="meta")})
    ckpt.close()


# --- CUDA (skipped without a device) -----------------------------------------------------------


@cuda
@needs_cuda
@pytest.mark.parametrize("overlapped", [False, True])
def test_cuda_state_round_trips_into_onto_and_as_private_views(start_daemon: Callable[..., Proc], shm_root: Path, overlapped: bool) -> None:
    start_daemon()
    sock = shm_root / "daemon.sock"
    saved, ckpt = _train("cuda", 4, lambda opt: Checkpointer("gpu", socket_path=sock, overlap_with=opt if overlapped else None))
    slots = list(ckpt._commits._slots.values())
    assert slots and all(s.pinned is not None and s.pinned.active for s in slots if s.pinned is not None)
    ckpt.close()
    fresh = Checkpointer("gpu", socket_path=sock).restore()
    assert fresh is not None and fresh.state["model"]["0.weight"].is_cuda  # back on the device it was saved from
    assert _equal(fresh.state, saved)
    target = _snapshot(saved)
    target["model"] = {k: torch.zeros_like(v, device="cuda") for k, v in saved["model"].items()}
    into = Checkpointer("gpu", socket_path=sock).restore(into=target)
    assert into is not None and _equal(into.state["model"], saved["model"]) and target["model"]["0.weight"].is_cuda
    viewer = Checkpointer("gpu", socket_path=sock)
    views = viewer.restore(view=True)  # host views of the private mapping: a write stays private
    assert views is not None and views.state["model"]["0.weight"].device.type == "cpu"
    assert _equal(views.state["model"], saved["model"])
    views.state["model"]["0.weight"].add_(1)
    again = Checkpointer("gpu", socket_path=sock).restore(view=True)
    assert again is not None and _equal(again.state["model"], saved["model"])
    viewer.close()


@cuda
@needs_cuda
@pytest.mark.timeout(150)
def test_cuda_state_restores_from_a_daemon_on_a_huge_page_tmpfs(start_daemon: Callable[..., Proc], huge_tmpfs: Path) -> None:
    """The recommended daemon root: there a CUDA restore's pin of its shard never returned while
    the shard was mapped private (copy-on-write); it is mapped shared and read-only now."""
    root = huge_tmpfs / "ffplane"
    start_daemon(root=root)
    state = {f"w{i}": torch.randn(2 << 20, device="cuda") for i in range(4)}  # 32 MiB: 2 MiB pages
    ckpt = Checkpointer("huge", socket_path=root / "daemon.sock")
    ckpt.save(1, state)
    ckpt.close()
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    got = Checkpointer("huge", socket_path=root / "daemon.sock").restore(into=target)
    assert got is not None and got.step == 1 and _equal(target, state)
    fresh = Checkpointer("huge", socket_path=root / "daemon.sock").restore()
    assert fresh is not None and fresh.state["w0"].is_cuda and _equal(fresh.state, state)


@cuda
@needs_cuda
def test_mixed_cpu_and_cuda_state_razored_over_two_ranks(start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    start_daemon()
    sock = shm_root / "daemon.sock"
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    state = {
        "model": {f"w{i}": torch.randn(1 << 20, device=d) for i, d in enumerate(devices)},
        "host": torch.arange(1 << 18),
        "tied": None,
        "step": 3,
    }
    state["tied"] = state["model"]["w0"][:10]  # shares w0's storage: saved once, restored sharing it
    cks = [Checkpointer("mixed", Layout(dp=2, dp_rank=r), socket_path=sock) for r in range(2)]
    for ck in cks:
        ck.save(3, state)
        ck.close()
    got = Checkpointer("mixed", Layout(dp=2, dp_rank=1), socket_path=sock).restore()
    assert got is not None and _equal(got.state, state)
    assert got.state["host"].device.type == "cpu" and got.state["model"]["w0"].is_cuda
    assert got.state["tied"].untyped_storage().data_ptr() == got.state["model"]["w0"].untyped_storage().data_ptr()


def test_a_failed_overlapped_copy_raises_at_the_optimizer_step_and_gives_its_slot_back(
    start_daemon: Callable[..., Proc], shm_root: Path, fail_first_copy: Callable[[], None]
) -> None:
    start_daemon()
    p = torch.nn.Parameter(torch.ones(1 << 16))
    opt = torch.optim.SGD([p], lr=0.1)
    ckpt = Checkpointer("ov", socket_path=shm_root / "daemon.sock", overlap_with=opt)
    ckpt.save(0, {"p": p})
    fail_first_copy()
    ckpt.save(1, {"p": p})  # returns: the copy runs behind it
    p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="injected"):
        opt.step()  # the wait point hears what went wrong, before the weights change
    assert torch.equal(p.detach(), torch.ones_like(p))
    ckpt.save(2, {"p": p})  # the failed save's slot was given back
    ckpt.close()
    got = Checkpointer("ov", socket_path=shm_root / "daemon.sock").restore()
    assert got is not None and got.step == 2
