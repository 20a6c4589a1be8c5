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
    assert _same(many[0]["weights"], many[2]["weights"])  # the ranks agree
    assert _same(many[0]["weights"], one[0]["weights"]), "the summation order followed DDP's bucket layout"
    # DDP's own all-reduce on the same data does depend on the layout (what the hook is for),
    # and the hook averages like it up to the order of float additions
    plain_many = _train(tmp_path, "ddp-many", 0.01, "none")
    plain_one = _train(tmp_path, "ddp-one", 25, "none")
    assert not _same(plain_many[0]["weights"], plain_one[0]["weights"])
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(one[0]["weights"], plain_one[0]["weights"]))


def test_the_reduced_buffer_goes_back_into_every_gradient_contiguous_or_not() -> None:
    from trainer_client.link_hints import _scatter

    buffer = torch.zeros(20)
    grads = [buffer[0:6].view(2, 3), buffer[6:10], torch.zeros(3, 2).t()]  # the last one is not contiguous
    flat = torch.arange(16, dtype=torch.float32)
    _scatter(flat, grads)
    assert torch.equal(grads[0], flat[0:6].view(2, 3)) and torch.equal(grads[1], flat[6:10])
    assert torch.equal(grads[2], flat[10:16].view(2, 3))
    contiguous = [buffer[0:6].view(2, 3), buffer[6:16]]
    _scatter(flat.flip(0), contiguous)  # the one-call path
    assert torch.equal(buffer[:16], flat.flip(0))
