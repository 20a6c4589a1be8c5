"""Step time of a CPU training loop that checkpoints every step, against one that never does.

    python bench/overhead.py                        # 8 repeats x 20 timed steps per mode and model (~8 min)
    python bench/overhead.py --repeats 1 --steps 1 --batch 32   # smoke size

Two loops (see ``Loop``), each sized so a step takes about 0.2 s here: ``cnn`` (4 MiB of state,
compute-heavy; its ratio is the ``overhead_ratio`` target) and ``mlp`` (18 MiB, state-heavy,
reported beside it). Modes, rotated
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
    """``cnn``: 0.35 M parameters (4 MiB of state with AdamW), 32 images of 64x64 per step —
    compute-heavy, like most real steps. ``mlp``: 1.6 M parameters (18 MiB) on ``batch`` rows —
    state-heavy for its compute, where a per-step copy shows most."""

    def __init__(self, kind: str, batch: int) -> None:
        torch.manual_seed(0)
        nn = torch.nn
        if kind == "cnn":
            self.model: torch.nn.Module = nn.Sequential(
                nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 128, 3, padding=1, stride=2), nn.ReLU(),
                nn.Conv2d(128, 128, 3, padding=1, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 1000),
            )
            self.x = torch.randn(32, 3, 64, 64)
            self.y = torch.randint(0, 1000, (32,))
            self.loss = nn.functional.cross_entropy
        else:
            self.model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 256))
            self.x = torch.randn(batch, 256)
            self.y = torch.randn(batch, 256)
            self.loss = nn.functional.mse_loss
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def step(self) -> None:
        loss = self.loss(self.model(self.x), self.y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    def state(self, step: int) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": step}


def run_mode(mode: str, loop: Loop, steps: int, work: Path, socket: Path, job: str, first_step: int) -> float:
    import torch.distributed.checkpoint as dcp

    ck = Checkpointer(job, socket_path=socket) if mode == "ffplane" else None
    pending: Any = None
    times = []
    for i in range(first_step, first_step + steps + 2):  # the first two warm up (slots, DCP set-up)
        t = time.perf_counter()
        loop.step()
        if ck is not None:
            ck.save(i, loop.state(i))
        elif mode == "torch_save":
            torch.save(loop.state(i), work / "torch_save.pt")
        elif mode == "dcp_async":
            if pending is not None:
                pending.result()
            pending = dcp.async_save(loop.state(i), checkpoint_id=str(work / f"dcp-{job}-{i}"))
        if i >= first_step + 2:
            times.append(time.perf_counter() - t)
            if mode == "dcp_async":
                shutil.rmtree(work / f"dcp-{job}-{i - 2}", ignore_errors=True)
    if pending is not None:
        pending.result()
    if ck is not None:
        ck.close()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="cnn,mlp", help="cnn (the overhead_ratio target) and/or mlp (state-heavy)")
    p.add_argument("--batch", type=int, default=6144, help="rows per step of the mlp")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--out", default="overhead")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    import torch.distributed as dist

    kinds = args.models.split(",")
    samples: dict[str, dict[str, list[float]]] = {k: {m: [] for m in MODES} for k in kinds}
    state_bytes: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="ffplane-overhead-", dir="/tmp") as tmp:
        work = Path(tmp)
        (work / "data").mkdir()
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"file://{work / 'pg'}", rank=0, world_size=1)
        with LocalCluster(work, work / "data", secrets.token_hex(16)) as cluster:
            cluster.start_dataserver("--log-level", "warning")
            cluster.start_daemon("--log-level", "warning", budget_mb=512)
            for kind in kinds:
                loop = Loop(kind, args.batch)
                state_bytes[kind] = sum(t.numel() * t.element_size() for t in loop.model.parameters()) * 3
                for r in range(args.repeats):
                    for mode in MODES[r % len(MODES):] + MODES[: r % len(MODES)]:  # rotate: drift hits every mode alike
                        # one job per model: its slots are allocated once and reused, steps keep rising
                        first = (r * len(MODES) + MODES.index(mode)) * (args.steps + 2)
                        samples[kind][mode].append(run_mode(mode, loop, args.steps, work, cluster.socket(), f"overhead-{kind}", first))
                    print(f"{kind} repeat {r}: " + "  ".join(f"{m} {samples[kind][m][-1] * 1e3:.1f} ms" for m in MODES))
        dist.destroy_process_group()
    figures: dict[str, Any] = {}
    checks: dict[str, Any] = {}
    for kind in kinds:
        suffix = "" if kind == "cnn" else f"_{kind}"
        for m, v in samples[kind].items():
            figures[f"step_s_{m}{suffix}"] = {"min": min(v), "median": statistics.median(v), "max": max(v), "samples": v}
        for m in MODES[1:]:
            checks[f"overhead_ratio_{m}{suffix}"] = {
                "ratio": ratio(figures[f"step_s_{m}{suffix}"], figures[f"step_s_none{suffix}"]),
                "target": "<= 1.01" if m == "ffplane" and kind == "cnn" else "(reported)",
            }
    if "cnn" in kinds:
        checks["overhead_ratio"] = checks["overhead_ratio_ffplane"]
    config = {"models": kinds, "mlp_batch": args.batch, "steps": args.steps, "repeats": args.repeats, "state_bytes": state_bytes, "torch_threads": torch.get_num_threads()}
    out = write_results(args.out, figures, config, checks, args.results_dir)
    for name, c in checks.items():
        print(f"  {name:28s} {c['ratio']:6.3f}   {c['target']}")
    bar_chart(args.results_dir / f"{args.out}.png", [(k, v) for k, v in figures.items()], "step seconds (median of repeats)", "training step time, checkpoint every step")
    print(f"wrote {out}  (state bytes {state_bytes})")
    return {"figures": figures, "targets": checks}


if __name__ == "__main__":
    main()
