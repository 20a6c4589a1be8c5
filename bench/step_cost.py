"""What ffplane adds to a training step, and where it goes: the example GPT job (2 nodes x 2
workers, one torchrun per node, CPU/gloo) failure-free, steps per minute, beside the plain DDP
script without checkpoints, in the same run.

    python bench/step_cost.py                 # 200 steps x 3 repeats per variant (~8 min)
    python bench/step_cost.py --steps 30 --repeats 1 --variants plain,ffplane   # a smoke

Variants: ``plain`` (examples/train_plain.py, no checkpoint), ``ffplane`` (as shipped: a save
every step, the comm hook with one all-reduce per step in parameter order), and ablations of it
(bench/_ablate_job.py): ``per_tensor`` (the hook without the model: one all-reduce per gradient,
the previous default), ``buckets`` (DDP's bucket all-reduce: fast, not bitwise-stable across a
restore with > 2 ranks), ``no_hook`` (no link hints, no wait for the last save's replica),
``no_save``, ``data_only`` (``no_save`` and ``no_hook``: batches from the node cache and nothing
else of ffplane), ``no_save_buckets`` (``no_save`` with ``buckets``: what the reproducible reduction
costs where nothing is saved); and of the daemons (each in a cluster of its own, after the others): ``http_push``
(replicas pushed over HTTP, ``--bulk-port -1``), ``no_replicate`` (no replicas at all),
``fetch_single`` (one data-server request per step, ``--fetch-steps 1``, instead of runs),
``no_replica_wait`` (a commit answered before its replica exists, ``--replica-max-lag 0``: what the
at-most-one-lost-step wait costs; not a safe setting). And the
floor: ``floor`` is the plain job doing, every step, the least that keeping each step's state on
another process costs (copy, XXH3, a TCP send and a receive + XXH3 there: bench/_plain_job.py).
A step here is tiny (~25 ms of compute on 4 workers sharing 2 cores), so fixed per-step costs
show at their worst; real steps are 100-1000x longer.

Where the time goes: every run also records the CPU milliseconds per step of each kind of
process (workers, node daemons, data servers, torchrun agents; bench/_proc_cpu.py). The cores
are shared by all of them, so a variant's extra CPU per step, over 2 cores, is roughly its extra
step time.

Each variant's rate is also divided by plain's (and ffplane's by the floor's) within each repeat,
where they ran back to back: ``same_repeat_*`` figures (median and a bootstrap 90 % interval of
it), which drift between repeats does not move; the 0.8x target is judged on ffplane's.
``--together`` keeps the daemons' variants' clusters up for the whole run so that they pair too
(``python bench/step_cost.py --together --variants plain,ffplane,no_replica_wait``).
``--pool bench/results/step_cost*.json`` prints them over every repeat of several runs.

Writes bench/results/step_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, ci90_of_median, print_table, ratio, summary, write_results  # noqa: E402
from bench._proc_cpu import CpuSampler  # noqa: E402
from ffplane_harness.job_runner import LocalJobs  # noqa: E402

PLAIN = Path(__file__).resolve().parent / "_plain_job.py"
ABLATE = Path(__file__).resolve().parent / "_ablate_job.py"
VARIANTS = (
    "plain", "floor", "ffplane", "per_tensor", "buckets", "no_hook", "no_save", "data_only", "no_save_buckets", "http_push", "no_replicate",
    "fetch_single", "no_replica_wait",
)  # fmt: skip
ABLATIONS = {"data_only": "no_save+no_hook", "no_save_buckets": "no_save+buckets"}  # variants that combine ablations of the job
# variants of the daemons rather than the job: run as ffplane, on daemons started with these flags
DAEMON_ARGS = {
    "http_push": ["--bulk-port", "-1"],
    "no_replicate": ["--no-replicate"],
    "fetch_single": ["--fetch-steps", "1"],
    "no_replica_wait": ["--replica-max-lag", "0"],
}


def steps_per_min(jobs: LocalJobs, variant: str, job: str, skip: frozenset[int] = frozenset()) -> tuple[float, dict[str, float]]:
    """One failure-free run of ``jobs.steps`` steps: steps per minute from the first step done
    to the last (start-up excluded), and CPU ms per step by kind of process (not counting
    ``skip``: other clusters' servers, up and idle beside this one)."""
    os.environ.pop("FFPLANE_FLOOR", None)
    # every variant marks each step done ("saved"); the per-batch line (an XXH3 and a file append
    # a step, for the chaos soak) is the harness's, and only ffplane's variants would pay it
    jobs.batch_events = False
    if variant in ("plain", "floor"):
        jobs.script = PLAIN
        jobs.script_args = ["--data", str(jobs.work / "tokens.parquet"), "--save-every", str(10**9)]
        if variant == "floor":
            os.environ["FFPLANE_FLOOR"] = "1"
    else:
        jobs.script, jobs.script_args = ABLATE, []
        os.environ["FFPLANE_ABLATE"] = "" if variant in ("ffplane", *DAEMON_ARGS) else ABLATIONS.get(variant, variant)
        jobs.post("/v1/jobs", {"name": job, "dataset": "tokens", "dp": 4, "batch_per_rank": 8, "seed": 0, "max_steps": jobs.steps})
    with CpuSampler(skip=skip) as cpu:
        nodes = jobs.launch_job(job, [0, 1])
        jobs.wait_done(nodes, timeout_s=600)
    done = [e["t"] for e in jobs.events(job) if e["kind"] == "saved"]
    if len(done) < 4 * jobs.steps:
        raise RuntimeError(f"{variant}: {len(done)} step events for 4 ranks x {jobs.steps} steps; logs in {jobs.work}")
    firsts = sorted(done)[:4]  # every rank's first step done: the run is going
    return (jobs.steps - 1) / ((max(done) - max(firsts)) / 60), cpu.per_step(done, 4)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    ap.add_argument("--out", default="step_cost")
    ap.add_argument(
        "--together",
        action="store_true",
        help="keep the daemons' variants' clusters up beside the first and rotate every variant into each repeat, so they get "
        "same-repeat ratios too (each idle cluster costs every run its heartbeats; the CPU figures leave its processes out)",
    )
    ap.add_argument(
        "--pool", nargs="+", type=Path, metavar="JSON", help="print the same-repeat ratios pooled over these result files; no run"
    )
    args = ap.parse_args(argv)
    if args.pool:
        return {"figures": pool(args.pool)}
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown or "plain" not in variants:
        raise SystemExit(f"--variants must include plain and come from {VARIANTS}; got {sorted(unknown) or variants}")
    samples: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, dict[str, list[float]]] = {v: {} for v in variants}  # variant → kind → CPU ms per step, per run
    # One cluster per daemon configuration. By default the daemons' variants run after the
    # others, each on a cluster of its own; --together keeps every cluster up for the whole run.
    # Within a phase, variants rotate so drift hits all alike.
    groups = [[v for v in variants if v not in DAEMON_ARGS]] + [[v] for v in variants if v in DAEMON_ARGS]
    phases = [[v for group in groups for v in group]] if args.together else groups
    runs = 0
    for phase in phases:
        clusters: dict[str, LocalJobs] = {}
        try:
            for key in dict.fromkeys(map(_daemons_of, phase)):
                clusters[key] = LocalJobs(Path(tempfile.mkdtemp(prefix="ffplane-step-cost-")), args.steps)
                clusters[key].prepare([], rows=8192, daemon_args=DAEMON_ARGS.get(key, []))
            for r in range(args.repeats):
                for v in phase[r % len(phase) :] + phase[: r % len(phase)]:
                    jobs = clusters[_daemons_of(v)]
                    idle = frozenset(
                        p.pid for other in clusters.values() if other is not jobs for p in other.cluster.dataservers + other.cluster.daemons
                    )
                    runs += 1
                    t = time.monotonic()
                    rate, by_kind = steps_per_min(jobs, v, f"run{runs}", idle)
                    samples[v].append(rate)
                    for kind, ms in by_kind.items():
                        cpu[v].setdefault(kind, []).append(ms)
                    print(f"repeat {r} {v:12s} {rate:7.1f} steps/min  ({time.monotonic() - t:.0f} s)", flush=True)
        finally:
            for name in ("FFPLANE_ABLATE", "FFPLANE_FLOOR"):
                os.environ.pop(name, None)
            for jobs in clusters.values():
                jobs.close()
                shutil.rmtree(jobs.work, ignore_errors=True)
    figures = {f"steps_per_min_{v}": summary(s) for v, s in samples.items()}
    for v, kinds in cpu.items():
        for kind, per_run in kinds.items():
            figures[f"cpu_ms_per_step_{v}_{kind.replace(' ', '_')}"] = summary(per_run)
    base = figures["steps_per_min_plain"]
    targets = {"ffplane": ">= 0.8", "floor": "(the least a save every step costs here: the most ffplane could reach)"}
    checks = {
        f"{v}_vs_plain": {"ratio": ratio(figures[f"steps_per_min_{v}"], base), "target": targets.get(v, "(reported)")}
        for v in variants
        if v != "plain"
    }
    if "floor" in variants and "ffplane" in variants:
        checks["ffplane_vs_floor"] = {
            "ratio": ratio(figures["steps_per_min_ffplane"], figures["steps_per_min_floor"]),
            "target": "(reported)",
        }
    figures.update(same_repeat(samples, phases[0]))
    judged = figures.get("same_repeat_ffplane_vs_plain")
    if judged is not None:  # the target's figure: drift between repeats moves the ratio of medians, not this
        checks["ffplane_vs_plain"]["target"] = "(reported: the target is judged on the same-repeat ratio)"
        checks["same_repeat_ffplane_vs_plain"] = {"ratio": judged["median"], "ci90": judged["ci90"], "target": ">= 0.8"}
    config = {
        "nodes": 2,
        "workers_per_node": 2,
        "steps": args.steps,
        "repeats": args.repeats,
        "launcher": "torchrun (c10d, one per node)",
        "together": args.together,
    }
    path = write_results(args.out, figures, config, checks, args.results_dir)
    rates = [(k, v) for k, v in figures.items() if k.startswith("steps_per_min_")]
    print_table([(k, v, "(baseline)" if k.endswith("plain") else f"{ratio(v, base):.2f} x plain") for k, v in rates], "steps/min")
    _print_paired({k: v for k, v in figures.items() if k.startswith("same_repeat_")})
    _print_cpu(cpu)
    print(f"wrote {path}")
    return {"figures": figures, "targets": checks}


def _daemons_of(variant: str) -> str:
    """The daemon configuration a variant runs on: its own for the daemons' variants, else the shipped one ("")."""
    return variant if variant in DAEMON_ARGS else ""


def same_repeat(samples: dict[str, list[float]], back_to_back: list[str]) -> dict[str, dict[str, Any]]:
    """Each variant's rate over plain's (ffplane's over the floor's, a daemons' variant's over
    ffplane's), repeat by repeat, for the variants that ran back to back, in rotation
    (``back_to_back``): the machine's drift between repeats (here up to 40 % of plain's own rate)
    cancels. Without ``--together`` the daemons'
    variants ran in clusters of their own, after the others, so they have no same-repeat partner."""
    pairs = [(v, "plain") for v in back_to_back if v != "plain"]
    if {"ffplane", "floor"} <= set(back_to_back):
        pairs.append(("ffplane", "floor"))
    if "ffplane" in back_to_back:  # a daemons' variant is ffplane on other daemons: what that change does
        pairs += [(v, "ffplane") for v in back_to_back if v in DAEMON_ARGS]
    return {f"same_repeat_{v}_vs_{b}": _paired([x / y for x, y in zip(samples[v], samples[b])]) for v, b in pairs}


def _paired(ratios: list[float]) -> dict[str, Any]:
    """min/median/max of per-repeat ratios, and a bootstrap 90 % interval of their median."""
    return {**summary(ratios), "ci90": ci90_of_median(ratios)}


def pool(paths: list[Path]) -> dict[str, Any]:
    """The same-repeat ratios over every repeat of several result files (their samples are in
    repeat order), printed; no run."""
    pooled: dict[str, list[float]] = {}
    for path in paths:
        result = json.loads(path.read_text())
        figures, together = result["figures"], result.get("config", {}).get("together", False)
        samples = {v: figures[f"steps_per_min_{v}"]["samples"] for v in VARIANTS if f"steps_per_min_{v}" in figures}
        for name, fig in same_repeat(samples, [v for v in samples if together or v not in DAEMON_ARGS]).items():
            pooled.setdefault(name, []).extend(fig["samples"])
    figures = {name: _paired(ratios) for name, ratios in sorted(pooled.items())}
    _print_paired(figures)
    for name, fig in figures.items():
        if name.endswith("_vs_plain"):  # how often a single repeat reads the target, ffplane's and its floor's alike
            v = name.removeprefix("same_repeat_").removesuffix("_vs_plain")
            print(f"{v} >= 0.8x plain in {sum(r >= 0.8 for r in fig['samples'])} of {len(fig['samples'])} repeats")
    return figures


def _print_paired(figures: dict[str, dict[str, Any]]) -> None:
    print_table(
        [(k, v, f"{len(v['samples'])} repeats, median's 90% CI {v['ci90'][0]:.3f}-{v['ci90'][1]:.3f}") for k, v in figures.items()], "ratio"
    )


def _print_cpu(cpu: dict[str, dict[str, list[float]]]) -> None:
    """CPU ms per step (medians) by variant and kind of process, beside the plain job's total."""
    kinds = sorted({k for kinds in cpu.values() for k in kinds})
    total = {v: sum(statistics.median(ms) for ms in kinds.values()) for v, kinds in cpu.items()}
    print(f"\nCPU ms per step (median of the runs){'':6s}" + "".join(f"{k:>15s}" for k in kinds) + f"{'total':>9s}{'vs plain':>10s}")
    for v, by_kind in cpu.items():
        cells = "".join(f"{statistics.median(by_kind[k]):15.2f}" if k in by_kind else f"{'-':>15s}" for k in kinds)
        extra = f"{total[v] - total['plain']:+9.2f}" if "plain" in total else ""
        print(f"{v:41s}{cells}{total[v]:9.2f}{extra:>10s}")


if __name__ == "__main__":
    main()
