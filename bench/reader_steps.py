"""What a cached step costs the reader beyond its copy, and the daemon per ``get``.

    python bench/reader_steps.py               # 192 cached 4 MiB steps x 3 repeats per consumer (~2 min)
    python bench/reader_steps.py --steps 16 --repeats 1 --gib 0.05   # smoke size

The node cache holds every step of a job (4 MiB of int32 tokens each, on a ``huge=within_size``
tmpfs when root); the DataLoader then reads them with two consumers in turn: ``copy`` copies
each batch into a training buffer (as bench/data_path.py's node-cache read does) and ``sleep``
sleeps as long as that copy takes (a step that computes without touching memory). Per consumer:

* ``step_ms`` — wall time per step; ``copy_ms`` — the consumer's own part (the baseline);
* ``gap_ms`` — the time the training thread spends in ``next()`` between two consumer parts,
  and of it ``get_ms`` (taking the look-ahead's result), ``to_torch_ms`` (the batch's tensor
  views), ``prefetch_ms`` (handing the next step to the look-ahead thread) and ``other_ms`` (the
  rest: the generator and the loop's own Python, run with caches the copy just flushed);
* ``ahead_fraction`` — steps whose look-ahead fetch started before the training thread asked;
* ``daemon_cpu_ms_per_get`` — the node daemon's CPU per step read (its ``get`` handling).

Results: ``bench/results/reader_steps.json``. docs/decisions.md ("Data path, third pass") reads them.
"""

from __future__ import annotations

import secrets
import statistics
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import cpu_s, huge_tmpfs, print_table, ratio, summary, write_results  # noqa: E402
from bench.data_path import _create_job, _wait_cached, reader_bench_dataset, reader_bench_parser  # noqa: E402
from ffplane_harness.local_cluster import LocalCluster  # noqa: E402
from trainer_client import DataLoader  # noqa: E402


class _Traced(DataLoader):
    """Stamps when the look-ahead thread starts each step's fetch and times the training
    thread's calls in ``next()`` (measurement only)."""

    started: dict[int, float]
    spent: dict[str, list[float]]

    def _fetch(self, step: int) -> Any:
        self.started[step] = time.perf_counter()
        return super()._fetch(step)

    def _timed(self, name: str, fn: Any, *args: Any) -> Any:
        t = time.perf_counter()
        out = fn(*args)
        self.spent.setdefault(name, []).append(time.perf_counter() - t)
        return out

    def _get(self, step: int) -> Any:
        (step_bytes, batch, meta), staged = self._timed("get", super()._get, step)
        # Weakly: a wrapper holding its own step's bound method is a reference cycle, which left
        # each step to the garbage collector — unmapped in batches, on whichever thread collected
        # — and made this benchmark 15 % faster than the plain DataLoader.
        to_torch = weakref.WeakMethod(step_bytes.to_torch)
        step_bytes.to_torch = lambda b: self._timed("to_torch", to_torch(), b)
        return (step_bytes, batch, meta), staged

    def _prefetch(self, step: int) -> None:
        self._timed("prefetch", super()._prefetch, step)


def _read(loader: _Traced, consumer: str, copy_s: float, batch: int, seq: int) -> dict[str, float]:
    buf = torch.ones((batch, seq), dtype=torch.int32)
    asked: dict[int, float] = {}
    parts: list[tuple[float, float]] = []
    it = iter(loader)
    t0 = time.perf_counter()
    while True:
        step = loader.next_step
        asked[step] = time.perf_counter()
        try:
            b = next(it)
        except StopIteration:
            break
        a = time.perf_counter()
        if consumer == "copy":
            buf.copy_(b["tokens"])
        else:
            time.sleep(copy_s)
        parts.append((a, time.perf_counter()))
    n = len(parts)
    first = min(asked)  # its fetch was started by the caller, before the clock
    gap = statistics.median(parts[i + 1][0] - parts[i][1] for i in range(n - 1)) * 1e3
    calls = {f"{k}_ms": statistics.median(v[1:]) * 1e3 for k, v in loader.spent.items()}  # [0]: before the clock
    return {
        "step_ms": (parts[-1][1] - t0) / n * 1e3,
        "copy_ms": statistics.median(e - a for a, e in parts) * 1e3,
        "gap_ms": gap,
        **calls,
        "other_ms": gap - sum(calls.values()),
        "ahead_fraction": sum(1 for s, t in asked.items() if s != first and loader.started.get(s, t) < t) / max(1, n - 1),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = reader_bench_parser(__doc__ or "", 192, "cached steps read per repeat", "reader_steps").parse_args(argv)
    ds_dir = reader_bench_dataset(args)
    step_bytes = args.batch * args.seq * 4
    token, run_id = secrets.token_hex(16), secrets.token_hex(3)
    budget_mb = max(512, 2 * (args.steps + 1) * step_bytes >> 20)
    samples: dict[str, dict[str, list[float]]] = {c: {} for c in ("copy", "sleep")}
    copy_s = 0.0
    with huge_tmpfs(args.work / "shm-huge", budget_mb + 64, args.huge) as huge:
        with LocalCluster(args.work, ds_dir.parent, token, shm_parent=huge or Path("/dev/shm")) as cluster:
            ds = cluster.start_dataserver("--log-level", "warning")
            daemon = cluster.start_daemon("--window", str(args.steps + 1), "--log-level", "warning", budget_mb=budget_mb)
            for r in range(args.repeats):
                for consumer in ("copy", "sleep"):  # sleep as long as the copy of this repeat took
                    job = f"steps-{run_id}-{r}-{consumer}"
                    _create_job(ds.url, token, job, args.batch, args.steps + 1, seed=r)
                    loader = _Traced(job, 0, dataserver=ds.url, token=token, socket_path=cluster.socket())
                    loader.started, loader.spent = {}, {}
                    next(iter(loader))  # step 0: the daemon starts prefetching the whole job
                    _wait_cached(daemon.url, job, args.steps + 1)
                    before = cpu_s(daemon.pid)
                    got = _read(loader, consumer, copy_s, args.batch, args.seq)
                    got["daemon_cpu_ms_per_get"] = (cpu_s(daemon.pid) - before) / args.steps * 1e3
                    loader.close()
                    if consumer == "copy":
                        copy_s = got["copy_ms"] / 1e3
                    for k, v in got.items():
                        samples[consumer].setdefault(k, []).append(v)
    figures = {f"{c}_{k}": summary(v) for c, d in samples.items() for k, v in d.items()}
    checks = {
        f"{c}_step_vs_copy": {
            "ratio": ratio(figures[f"{c}_step_ms"], figures["copy_copy_ms"]),
            "target": "(reported: 1.0 would be a free reader)",
        }
        for c in samples
    }
    out = write_results(
        args.out,
        figures,
        {"steps": args.steps, "step_bytes": step_bytes, "repeats": args.repeats, "cache_pages": "2 MiB" if huge else "4 KiB"},
        checks,
        args.results_dir,
    )
    print_table([(k, v, "") for k, v in figures.items()], "ms / fraction")
    for name, c in checks.items():
        print(f"  {name:24s} {c['ratio']:6.2f}")
    print(f"wrote {out}")
    return {"figures": figures, "targets": checks}


if __name__ == "__main__":
    main()
