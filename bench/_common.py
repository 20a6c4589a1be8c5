"""Shared benchmark plumbing: repeat a measurement, summarise it, write results, compare."""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def cpu_by_thread(pid: int) -> dict[int, float]:
    """thread id → CPU seconds it has run, from the scheduler's nanosecond counts
    (``/proc/<pid>/task/<tid>/schedstat``; ``stat`` counts 10 ms ticks)."""
    out = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                out[int(task)] = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError):
            pass  # a thread that just ended
    return out


def cpu_s(pid: int) -> float:
    """CPU seconds all of a process's threads have run."""
    return sum(cpu_by_thread(pid).values())


def summary(samples: list[float]) -> dict[str, Any]:
    """min/median/max of ``samples``, plus every sample."""
    return {"min": min(samples), "median": statistics.median(samples), "max": max(samples), "samples": samples}


def ci90_of_median(ratios: list[float], resamples: int = 2000) -> tuple[float, float]:
    """A bootstrap 90 % interval of the median of ``ratios`` (paired ratios, one per round or
    repeat): how far the median could move on another run of as many."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return medians[int(0.05 * resamples)], medians[int(0.95 * resamples) - 1]


def repeat(fn: Callable[[], float], times: int) -> dict[str, Any]:
    """Run ``fn`` ``times`` times; the summary of what it returns."""
    return summary([fn() for _ in range(times)])


def write_results(name: str, figures: dict[str, Any], config: dict[str, Any], checks: dict[str, Any], directory: Path = RESULTS) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / f"{name}.json"
    out.write_text(
        json.dumps(
            {
                "benchmark": name,
                "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "machine": {"python": platform.python_version(), "cpus": __import__("os").cpu_count(), "platform": platform.platform()},
                "config": config,
                "figures": figures,
                "targets": checks,
            },
            indent=1,
        )
    )
    return out


def ratio(a: dict[str, Any], b: dict[str, Any]) -> float:
    return float(a["median"]) / float(b["median"]) if b["median"] else float("inf")


def print_table(rows: list[tuple[str, dict[str, Any], str]], unit: str) -> None:
    print(f"{'figure':34s} {'min':>9s} {'median':>9s} {'max':>9s}  {unit}   vs baseline")
    for name, fig, note in rows:
        print(f"{name:34s} {fig['min']:9.3f} {fig['median']:9.3f} {fig['max']:9.3f}  {' ' * len(unit)}   {note}")


def bar_chart(path: Path, rows: list[tuple[str, dict[str, Any]]], ylabel: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = [r[0] for r in rows]
    med = [r[1]["median"] for r in rows]
    lo = [r[1]["median"] - r[1]["min"] for r in rows]
    hi = [r[1]["max"] - r[1]["median"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar(names, med, yerr=[lo, hi], capsize=4, color="#4c72b0")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@contextmanager
def huge_tmpfs(where: Path, size_mb: int, mode: str) -> Iterator[Path | None]:
    """A tmpfs mounted ``huge=within_size`` at ``where`` for the run (None if not possible):
    the recommended node-daemon root (docs/deployment.md)."""
    if mode == "off":
        yield None
        return
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,huge=within_size", "tmpfs", str(where)], capture_output=True, text=True
    )
    if done.returncode != 0:
        print(f"cannot mount a huge-page tmpfs ({done.stderr.strip()}); measuring on /dev/shm")
        yield None
        return
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
