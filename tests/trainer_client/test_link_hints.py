from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("_hook_worker.py")


def _train(tmp_path: Path, name: str, bucket_mb: float, hook: str, world: int = 3) -> list[dict[str, object]]:
    """Run ``world`` real DDP ranks (gloo) for 4 steps; every rank's calls and final weights."""
    run = tmp_path / name
    (run / "hints").mkdir(parents=True)
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), str(world), str(run / "init"), str(run), str(bucket_mb), hook, str(run / f"rank{r}.pt")]
        )
        for r in range(world)
    ]
    try:
        for p in procs:
            assert p.wait(timeout=120) == 0, f"rank of {name} failed"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [torch.load(run / f"rank{r}.pt") for r in range(world)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_the_step_hook_is_one_collective_a_step_and_independent_of_bucket_layout(tmp_path: Path) -> None:
    # 6 layers of 16 KiB of gradients each: a 0.01 MB cap makes several buckets, 25 MB one
    many = _train(tmp_path, "many-buckets", 0.01, "step")
    one = _train(tmp_path, "one-bucket", 25, "step")
    assert all(r["calls"] == 4 for r in many + one), [r["calls"] for r in many]  # one all-reduce per step
    # laid out on the first step and again once DDP rebuilt its buckets, not every step
    assert all(1 <= r["plans"] <= 2 for r in many + one), [r["plans"] for r in many + one]
    assert _same(many[0]["weights"], many[2]["weights"])  # the ranks agree
    assert _same(many[0]["weights"], one[0]["weights"]), "the summation order followed DDP's bucket layout"
    # DDP's own all-reduce on the same data does depend on the layout (what the hook is for),
    # and the hook averages like it up to the order of float additions
    plain_many = _train(tmp_path, "ddp-many", 0.01, "none")
    plain_one = _train(tmp_path, "ddp-one", 25, "none")
    assert not _same(plain_many[0]["weights"], plain_one[0]["weights"])
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(one[0]["weights"], plain_one[0]["weights"]))


def test_a_flat_buffer_gathers_every_gradient_and_gives_it_back_contiguous_or_not() -> None:
    from trainer_client._copy import copy_all
    from trainer_client.link_hints import _Flat

    buffer = torch.arange(20, dtype=torch.float32)
    grads = [buffer[0:6].view(2, 3), buffer[6:10], torch.arange(6, dtype=torch.float32).view(2, 3).t()]  # the last one is strided
    f = _Flat.of(grads)
    copy_all(f.gather, None, 1)
    assert torch.equal(f.flat, torch.cat([g.reshape(-1) for g in grads]))
    f.flat.mul_(-1)
    copy_all(f.scatter, None, 1)
    assert torch.equal(buffer[:10], -torch.arange(10, dtype=torch.float32))
    assert torch.equal(grads[2], -torch.arange(6, dtype=torch.float32).view(2, 3).t())
