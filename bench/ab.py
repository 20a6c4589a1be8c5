"""Old code against new on the same machine: benchmarks run from two git revisions, alternated
round by round, so drift of the machine (page cache, turbo, a neighbour) falls on both sides.

    python bench/ab.py --old 725d2c3                 # the renovation check of issue 41
    python bench/ab.py --old REV --new REV --rounds 3 --only save_cpu

Each revision is checked out into a worktree of its own (removed afterwards) and each benchmark
runs there as ``python -m bench.<name>``, with ``PYTHONPATH`` naming that worktree, so its servers
and workers run that revision's code. Per figure: both sides' min/median/max over the rounds, the
ratio of medians new/old, ``within_spread``: whether the two sides' ranges overlap (a change
smaller than either side's own run-to-run spread is no change this benchmark can see), and
``worse_beyond_spread``: whether the new side is worse than the old one's whole range.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import RESULTS, summary, write_results

ROOT = Path(__file__).resolve().parent.parent

# benchmark → (its arguments, sized so a round of all three takes a few minutes; the figures
# compared, as paths into its results' "figures", each ending at a min/median/max summary)
PLAN: dict[str, tuple[list[str], list[str]]] = {
    "save_cpu": (
        ["--cases", "cnn,fsdp2,256", "--saves", "300", "--fsdp2-saves", "50", "--repeats", "1"],
        ["cnn_save_ms", "cnn_total_ms", "fsdp2_save_ms", "256mib_worker_s_per_gib", "256mib_total_s_per_gib", "round_trip_us"],
    ),
    "data_path": (
        ["--gib", "0.25", "--steps", "48", "--cached-steps", "96", "--repeats", "1", "--no-mosaic"],
        ["node_cache_read_gbps", "end_to_end_gbps", "control_rtt_us"],
    ),
    "recovery": (
        ["--k", "", "--repeats", "3", "--goodput-failures", "1", "--goodput-interval", "10"],
        ["ffplane/worker SIGKILL/mttr_s", "ffplane/worker SIGKILL/stages_median_s/restored"],
    ),
}


def _worktree(rev: str, where: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(where), rev], check=True, capture_output=True)
    return where


def _figure(figures: dict[str, Any], path: str) -> float:
    node: Any = figures
    for part in path.split("/"):
        node = node[part]
    return float(node["median"] if isinstance(node, dict) else node)


def _run(tree: Path, bench: str, args: list[str], out: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", f"bench.{bench}", *args, "--results-dir", str(out), "--out", bench]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"bench.{bench} failed in {tree}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    figures: dict[str, Any] = json.loads((out / f"{bench}.json").read_text())["figures"]
    return figures


def compare(name: str, old_samples: list[float], new_samples: list[float]) -> dict[str, Any]:
    """Both sides' summaries; ``within_spread``: the ranges overlap; ``worse_beyond_spread``: the
    new side's whole range is on the worse side of the old one's (rates end in ``_gbps``: higher
    is better; every other figure here is a time: lower is better)."""
    old, new = summary(old_samples), summary(new_samples)
    higher_is_better = name.endswith("_gbps")
    worse = new["max"] < old["min"] if higher_is_better else new["min"] > old["max"]
    within = new["min"] <= old["max"] and old["min"] <= new["max"]
    return {"old": old, "new": new, "ratio": new["median"] / old["median"], "within_spread": within, "worse_beyond_spread": worse}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, help="the revision measured as the baseline")
    p.add_argument("--new", default="HEAD", help="the revision measured against it (default HEAD)")
    p.add_argument("--rounds", type=int, default=3, help="old/new pairs per benchmark; the first side alternates")
    p.add_argument("--only", default=",".join(PLAN), help="comma-separated benchmarks of the plan")
    p.add_argument("--out", default="ab")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    benches = [b for b in args.only.split(",") if b]
    unknown = sorted(set(benches) - set(PLAN))
    if unknown or args.rounds < 1:
        p.error(f"unknown benchmark(s) {unknown} (known: {sorted(PLAN)})" if unknown else "--rounds must be at least 1")
    work = Path(tempfile.mkdtemp(prefix="ffplane-ab-"))
    samples: dict[str, dict[str, list[float]]] = {}
    try:
        trees = {side: _worktree(rev, work / side) for side, rev in (("old", args.old), ("new", args.new))}
        for bench in benches:
            bench_args, keys = PLAN[bench]
            for r in range(args.rounds):
                for side in ("old", "new") if r % 2 == 0 else ("new", "old"):
                    print(f"[{bench}] round {r + 1}/{args.rounds}: {side}", flush=True)
                    got = _run(trees[side], bench, bench_args, work / f"out-{side}")
                    for key in keys:
                        samples.setdefault(f"{bench}/{key}", {"old": [], "new": []})[side].append(_figure(got, key))
    finally:
        for side in ("old", "new"):
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work / side)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    figures = {name: compare(name, sides["old"], sides["new"]) for name, sides in samples.items()}
    print(f"\n{'figure':58s} {'old median':>12s} {'new median':>12s} {'new/old':>8s}  within spread  worse beyond it")
    for name, f in figures.items():
        print(
            f"{name:58s} {f['old']['median']:12.4g} {f['new']['median']:12.4g} {f['ratio']:8.3f}  {f['within_spread']!s:13s}  {f['worse_beyond_spread']}"
        )
    config = {"old": args.old, "new": args.new, "rounds": args.rounds, "plan": {b: PLAN[b][0] for b in benches}}
    checks = {
        "all_within_spread": all(f["within_spread"] for f in figures.values()),
        "none_worse_beyond_spread": not any(f["worse_beyond_spread"] for f in figures.values()),
    }
    path = write_results(args.out, figures, config, checks, args.results_dir)
    print(f"targets: {checks}\nwrote {path}")
    return {"figures": figures, "targets": checks}


if __name__ == "__main__":
    main()
