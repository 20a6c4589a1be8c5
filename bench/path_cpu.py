"""Where the end-to-end data path spends its CPU, process by process, per step.

    python bench/path_cpu.py                      # 300 steps x 3 repeats (~1 min)
    python bench/path_cpu.py --steps 40 --repeats 1   # smoke size
    python bench/path_cpu.py --batch 8 --seq 64 --gib 0.01 --work /tmp/ffplane-bench-tokens --out path_cpu_tokens
        # small steps (tokens); add --fetch-steps 1 --out path_cpu_tokens_single for a request per step

On this 2-core machine the data server, the node daemon and the reader share the cores, so the
end-to-end rate is about ``cores / (CPU per step)``: every CPU-millisecond a process spends per
step is what to cut. Each repeat starts a fresh job (data server → daemon over HTTP → DataLoader,
each 4 MiB batch copied into a training buffer, as ``bench/data_path.py``'s end-to-end read) and
reads ``--steps`` steps; measured per step, from the scheduler's per-process CPU counts:

* ``dataserver_ms``, ``daemon_ms``, ``reader_ms`` (the training process: DataLoader and copy)
  and ``total_ms``; ``gbps`` — the rate of the same run;
* baseline, same run: ``stack_ms`` — the CPU the required HTTP stack alone (FastAPI/uvicorn →
  aiohttp, constant bodies of a step's size, ``bench/_http_stack.py``) spends per step.

To see inside a process, record it while this runs, e.g. ``perf record -F 999 -p <daemon pid>``
(the ready files under ``--work`` name the pids). Results: ``bench/results/path_cpu.json``;
docs/decisions.md ("Data server: one gather, encode on the loop, keep the heap" and "The daemon
fetches one step per request, 4 in flight") read them.
"""

from __future__ import annotations

import secrets
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import cpu_s, huge_tmpfs, print_table, ratio, summary, write_results  # noqa: E402
from bench._http_stack import http_stack  # noqa: E402
from bench.data_path import _consume, _create_job, reader_bench_dataset, reader_bench_parser  # noqa: E402
from ffplane_harness.local_cluster import LocalCluster  # noqa: E402
from trainer_client import DataLoader  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = reader_bench_parser(__doc__ or "", 300, "steps read per repeat", "path_cpu")
    parser.add_argument("--fetch-steps", type=int, default=16, help="the daemon's --fetch-steps (runs apply to steps of at most 256 KiB)")
    args = parser.parse_args(argv)
    ds_dir = reader_bench_dataset(args)
    step_bytes = args.batch * args.seq * 4
    token, run_id = secrets.token_hex(16), secrets.token_hex(3)
    samples: dict[str, list[float]] = {}
    with huge_tmpfs(args.work / "shm-huge", 576, args.huge) as huge:
        with LocalCluster(args.work, ds_dir.parent, token, shm_parent=huge or Path("/dev/shm")) as cluster:
            ds = cluster.start_dataserver("--log-level", "warning")
            daemon = cluster.start_daemon("--log-level", "warning", "--fetch-steps", str(args.fetch_steps), budget_mb=512)
            for r in range(args.repeats + 1):  # the first warms the dataset's pages: not kept
                job = f"cpu-{run_id}-{r}"
                _create_job(ds.url, token, job, args.batch, args.steps + 1, seed=r)
                loader = DataLoader(job, 0, dataserver=ds.url, token=token, socket_path=cluster.socket())
                batches = iter(loader)
                next(batches)  # connections open, the job's plan made
                before = (cpu_s(ds.pid), cpu_s(daemon.pid), time.process_time())
                nbytes, secs = _consume(batches, args.batch, args.seq)
                after = (cpu_s(ds.pid), cpu_s(daemon.pid), time.process_time())
                loader.close()
                if r == 0:
                    continue
                per = {k: (a - b) / args.steps * 1e3 for k, a, b in zip(("dataserver_ms", "daemon_ms", "reader_ms"), after, before)}
                per["total_ms"] = sum(per.values())
                per["gbps"] = nbytes / secs / 1e9
                for k, v in per.items():
                    samples.setdefault(k, []).append(v)
    for _ in range(args.repeats):
        _, cpu_per_gb = http_stack(step_bytes, args.steps * step_bytes)
        samples.setdefault("stack_ms", []).append(cpu_per_gb * step_bytes / 1e9 * 1e3)
    figures = {k: summary(v) for k, v in samples.items()}
    checks = {
        "total_vs_stack": {
            "ratio": ratio(figures["total_ms"], figures["stack_ms"]),
            "target": "(reported: 1.0 would be a path that costs only the HTTP stack)",
        }
    }
    config = {
        "steps": args.steps,
        "repeats": args.repeats,
        "step_bytes": step_bytes,
        "shm_pages": "2 MiB" if huge else "4 KiB",
        "fetch_steps": args.fetch_steps,
    }
    out = write_results(args.out, figures, config, checks, args.results_dir)
    print_table([(k, v, "(baseline: the HTTP stack alone)" if k == "stack_ms" else "") for k, v in figures.items()], "CPU ms / step")
    print(f"  total / stack {checks['total_vs_stack']['ratio']:.2f}")
    print(f"wrote {out}")
    return {"figures": figures, "targets": checks}


if __name__ == "__main__":
    main()
