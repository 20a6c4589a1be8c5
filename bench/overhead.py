"""Step time of a CPU training loop that checkpoints every step, against one that never does.

    python bench/overhead.py                        # 5 repeats x 20 timed steps per mode (~4 min)
    python bench/overhead.py --repeats 1 --steps 3 --batch 64   # smoke size

The loop: an MLP (256 → 1024 → 1024 → 256, 1.6 M parameters, AdamW: ~19 MB of state) on
batches of ``--batch`` rows, sized so a step takes about 0.1–0.3 s here. Modes, interleaved
within each repeat: ``none``; ``ffplane`` (``Checkpointer.save`` every step); ``torch_save``
(``torch.save`` to local disk every step); ``dcp_async`` (``dcp.async_save`` every step, waiting
for the previous one first, as its docs require). The figure per mode is the median step time of
a repeat; ``overhead_ratio`` = mode / none.

Why the state/compute ratio matters: a checkpoint copies ~12 bytes per parameter, a step computes
~6 FLOPs per parameter per token, so the copy's share of a step is ≈ 2·FLOPS / (tokens·bandwidth)
— ~1 % needs ≥ ~1,200 tokens (rows) per step on this CPU. Real LLM steps have far more.
Results: ``bench/results/overhead.json`` and ``overhead.png``.
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, bar_chart, ratio, write_results  # noqa: E402
from trainer_client import Checkpointer  # noqa: E402
from trainer_client.local_cluster import LocalCluster  # noqa: E402

MODES = ("none", "ffplane", "torch_save", "dcp_async")


class Loop:
    def __init__(self, batch: int) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.x = torch.randn(batch, 256)
        self.y = torch.randn(batch, 256)

    def step(self) -> None:
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    def state(self, step: int) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": step}


def run_mode(mode: str, loop: Loop, steps: int, work: Path, socket: Path, job: str) -> float:
    import torch.distributed.checkpoint as dcp

    ck = Checkpointer(job, socket_path=socket) if mode == "ffplane" else None
    pending: Any = None
    times = []
    for i in range(steps + 2):  # the first two are warm-up (slot allocation, DCP set-up)
        t = time.perf_counter()
        loop.step()
        if ck is not None:
            ck.save(i, loop.state(i))
        elif mode == "torch_save":
            torch.save(loop.state(i), work / "torch_save.pt")
        elif mode == "dcp_async":
            if pending is not None:
                pending.result()
            pending = dcp.async_save(loop.state(i), checkpoint_id=str(work / f"dcp-{i}"))
        if i >= 2:
            times.append(time.perf_counter() - t)
        if mode == "dcp_async" and i >= 2:
            shutil.rmtree(work / f"dcp-{i - 2}", ignore_errors=True)
    if pending is not None:
        pending.result()
    if ck is not None:
        ck.close()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="overhead")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    import torch.distributed as dist

    samples: dict[str, list[float]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="ffplane-overhead-", dir="/tmp") as tmp:
        work = Path(tmp)
        (work / "data").mkdir()
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"file://{work / 'pg'}", rank=0, world_size=1)
        loop = Loop(args.batch)
        state_bytes = sum(t.numel() * t.element_size() for t in loop.model.parameters()) * 3
        with LocalCluster(work, work / "data", secrets.token_hex(16)) as cluster:
            cluster.start_dataserver("--log-level", "warning")
            cluster.start_daemon("--log-level", "warning", budget_mb=512)
            for r in range(args.repeats):
                for mode in MODES:
                    samples[mode].append(run_mode(mode, loop, args.steps, work, cluster.socket(), f"overhead-{r}"))
                print(f"repeat {r}: " + "  ".join(f"{m} {samples[m][-1] * 1e3:.1f} ms" for m in MODES))
        dist.destroy_process_group()
    figures: dict[str, Any] = {
        f"step_s_{m}": {"min": min(v), "median": statistics.median(v), "max": max(v), "samples": v} for m, v in samples.items()
    }
    base = figures["step_s_none"]
    checks = {f"overhead_ratio_{m}": {"ratio": ratio(figures[f"step_s_{m}"], base), "target": "<= 1.01" if m == "ffplane" else "(baseline)"} for m in MODES[1:]}
    checks["overhead_ratio"] = checks["overhead_ratio_ffplane"]
    out = write_results(args.out, figures, {"batch": args.batch, "steps": args.steps, "repeats": args.repeats, "state_bytes": state_bytes, "torch_threads": torch.get_num_threads()}, checks, args.results_dir)
    for name, c in checks.items():
        print(f"  {name:28s} {c['ratio']:6.3f}   {c['target']}")
    bar_chart(args.results_dir / f"{args.out}.png", [(k, v) for k, v in figures.items()], "step seconds (median of repeats)", "training step time, checkpoint every step")
    print(f"wrote {out}  (state {state_bytes / 2**20:.1f} MiB)")
    return {"figures": figures, "targets": checks}


if __name__ == "__main__":
    main()
