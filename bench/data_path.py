"""The data path, end to end, beside the machine's limits and the peers users have today.

    python bench/data_path.py                 # ≥ 1 GiB of int32 tokens, 3 repeats (a few minutes)
    python bench/data_path.py --gib 0.05 --repeats 1 --no-mosaic   # smoke size (what the test runs)

Measured in one run, on one dataset of tokenised text (rows of ``--seq`` int32 tokens), with
``--batch`` rows per step (one dp rank):

* ``memcpy_gbps`` — numpy copy between two pre-faulted buffers of one step's size × 64;
* ``loopback_tcp_gbps`` — one Python TCP connection on 127.0.0.1 between two processes;
* ``http_stack_gbps`` — the required HTTP stack alone (FastAPI/uvicorn → aiohttp, 4 constant
  bodies of a step's size in flight, dropped on arrival): the ceiling under ``end_to_end_gbps``;
* ``node_cache_read_gbps`` — the DataLoader reading steps already in the node daemon's cache,
  every byte copied into a preallocated training buffer (so zero-copy views are not free). The
  cache root is a tmpfs the benchmark mounts with ``huge=within_size`` (the recommended
  deployment; needs root, else /dev/shm); ``node_cache_read_4k_pages_gbps`` is the same read
  from a daemon on /dev/shm (4 KiB pages);
* ``control_rtt_us`` — one worker↔daemon control round trip (Unix socket, JSON line) per batch;
* ``end_to_end_gbps`` — a fresh job: data server → daemon (HTTP) → DataLoader, same consumer;
* ``torch_dataloader_local_gbps`` — a plain torch DataLoader over the local Arrow shards
  (best of 0 and 2 workers, both recorded);
* ``mosaic_streaming_gbps`` — mosaicml-streaming over an MDS copy of the data (install it with
  ``echo 'torch==2.13.0+cpu' > /tmp/c.txt && pip install -c /tmp/c.txt mosaicml-streaming``).

Results: ``bench/results/data_path.json`` and ``data_path.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, bar_chart, huge_tmpfs, print_table, ratio, repeat, summary, write_results  # noqa: E402
from bench._http_stack import http_stack  # noqa: E402
from dataserver.ingest import IngestConfig, ingest  # noqa: E402
from ffplane_harness.local_cluster import LocalCluster  # noqa: E402
from trainer_client import DataLoader  # noqa: E402

GB = 1e9


def make_dataset(root: Path, gib: float, seq: int) -> Path:
    """``root/tokens``: ``gib`` GiB of random int32 tokens, reused if already there."""
    out = root / "datasets" / "tokens"
    rows = int(gib * (1 << 30)) // (seq * 4)
    manifest = out / "manifest.json"
    if manifest.exists() and json.loads(manifest.read_text())["num_samples"] == rows:
        return out
    src = root / "tokens-src.arrow"
    schema = pa.schema([("tokens", pa.list_(pa.int32(), seq))])
    rng = np.random.default_rng(0)
    with pa.ipc.new_file(str(src), schema) as w:
        for start in range(0, rows, 8192):
            n = min(8192, rows - start)
            block = rng.integers(0, 50_000, size=(n, seq), dtype=np.int32)
            block[:, 0] = np.arange(start, start + n)
            w.write_batch(pa.record_batch([pa.FixedSizeListArray.from_arrays(pa.array(block.reshape(-1)), seq)], schema=schema))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    ingest(IngestConfig([src], out, shard_bytes=256 << 20))
    src.unlink()
    return out


def reader_bench_parser(doc: str, steps: int, steps_help: str, out: str) -> argparse.ArgumentParser:
    """The options of the benchmarks that read this dataset through a node daemon
    (bench/reader_steps.py, bench/path_cpu.py); ``reader_bench_dataset`` then prepares it."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="dataset size in GiB of token data")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=512, help="rows per step (512 x 2048 int32 = 4 MiB)")
    p.add_argument("--steps", type=int, default=steps, help=steps_help)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", type=Path, default=Path("/tmp/ffplane-bench-data"), help="dataset folder (kept for reuse)")
    p.add_argument("--huge", choices=["auto", "off"], default="auto", help="cache root on a huge=within_size tmpfs (needs root)")
    p.add_argument("--out", default=out)
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    return p


def reader_bench_dataset(args: argparse.Namespace) -> Path:
    """The dataset of ``reader_bench_parser``'s options, with the consumer on one torch thread
    as in this benchmark (see ``main``)."""
    torch.set_num_threads(1)
    args.work.mkdir(parents=True, exist_ok=True)
    return make_dataset(args.work, args.gib, args.seq)


def memcpy_gbps(nbytes: int) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.ones(nbytes, dtype=np.uint8)  # both pre-faulted
    np.copyto(dst, src)
    t = time.perf_counter()
    for _ in range(5):
        np.copyto(dst, src)
    return 5 * nbytes / (time.perf_counter() - t) / GB


_RECEIVER = r"""
import socket, sys
total = int(sys.argv[1]); srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept(); buf = bytearray(4 << 20); view = memoryview(buf); got = 0
while got < total:
    n = conn.recv_into(view)
    if not n: break
    got += n
conn.sendall(b"k"); conn.close()
"""


def loopback_tcp_gbps(nbytes: int) -> float:
    """One Python TCP connection between two processes on loopback, 4 MiB sends."""
    recv = subprocess.Popen([sys.executable, "-c", _RECEIVER, str(nbytes)], stdout=subprocess.PIPE, text=True)
    try:
        assert recv.stdout is not None
        port = int(recv.stdout.readline())
        payload = memoryview(np.ones(4 << 20, dtype=np.uint8))
        with socket.create_connection(("127.0.0.1", port)) as s:
            t = time.perf_counter()
            sent = 0
            while sent < nbytes:
                # Exactly nbytes: the receiver closes once it has them, so an overshoot is a reset.
                chunk = payload[: min(len(payload), nbytes - sent)]
                s.sendall(chunk)
                sent += len(chunk)
            s.recv(1)
            return sent / (time.perf_counter() - t) / GB
    finally:
        recv.kill()
        recv.wait()


def _create_job(url: str, token: str, name: str, batch: int, max_steps: int, seed: int) -> None:
    body = {"name": name, "dataset": "tokens", "dp": 1, "batch_per_rank": batch, "seed": seed, "max_steps": max_steps}
    req = urllib.request.Request(
        url + "/v1/jobs", json.dumps(body).encode(), {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
    )
    urllib.request.urlopen(req).read()


def _consume(batches: Iterator[dict[str, Any]], batch: int, seq: int) -> tuple[int, float]:
    """Copy every batch into one preallocated training buffer; (bytes, seconds)."""
    buf = torch.ones((batch, seq), dtype=torch.int32)
    nbytes = 0
    t = time.perf_counter()
    for b in batches:
        tokens = b["tokens"]
        buf.copy_(tokens)
        nbytes += tokens.numel() * tokens.element_size()
    return nbytes, time.perf_counter() - t


def _wait_cached(daemon_url: str, job: str, steps: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cache = json.loads(urllib.request.urlopen(daemon_url + "/v1/cache").read())
        ready = [s for s in cache["streams"] if s["job"] == job]
        if ready and len(ready[0]["steps"]) >= steps:
            return
        time.sleep(0.05)
    raise TimeoutError(f"the daemon did not cache {steps} steps of {job} in {timeout_s}s")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="dataset size in GiB of token data")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=512, help="rows per step (512 x 2048 int32 = 4 MiB)")
    p.add_argument("--steps", type=int, default=96, help="steps read per end-to-end repeat")
    # 192 steps (768 MiB, ~0.15 s): the first ~50 after the idle wait for the cache run ~15 % slower
    # on this VM (its vCPUs start slow after idle); 48 steps measured mostly that transient
    p.add_argument("--cached-steps", type=int, default=192, help="steps read per node-cache repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", type=Path, default=Path("/tmp/ffplane-bench-data"), help="dataset folder (kept for reuse)")
    p.add_argument("--no-mosaic", action="store_true", help="skip mosaicml-streaming")
    p.add_argument(
        "--huge",
        choices=["auto", "off"],
        default="auto",
        help="auto: put the node cache on a tmpfs mounted huge=within_size (needs root; the "
        "recommended deployment, docs/deployment.md) and also measure /dev/shm; off: /dev/shm only",
    )
    p.add_argument("--out", default="data_path")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    # The consumer's copy runs on one thread for every system measured: torch's default intra-op
    # pool spin-waits and, on 2 cores, steals the CPU the servers need (measured: reader CPU 0.64
    # → 0.2 of a core, end to end +15%).
    torch.set_num_threads(1)

    step_bytes = args.batch * args.seq * 4
    args.work.mkdir(parents=True, exist_ok=True)
    print(f"dataset: {args.gib} GiB of int32 tokens, {args.seq} per row; step = {args.batch} rows = {step_bytes / 2**20:.1f} MiB")
    ds_dir = make_dataset(args.work, args.gib, args.seq)
    rows = json.loads((ds_dir / "manifest.json").read_text())["num_samples"]
    figures: dict[str, Any] = {}

    figures["memcpy_gbps"] = repeat(lambda: memcpy_gbps(min(step_bytes * 64, 1 << 30)), args.repeats)
    figures["loopback_tcp_gbps"] = repeat(lambda: loopback_tcp_gbps(args.steps * step_bytes), args.repeats)
    stack = [http_stack(step_bytes, args.steps * step_bytes) for _ in range(args.repeats)]
    figures["http_stack_gbps"] = summary([gbps for gbps, _ in stack])
    figures["http_stack_cpu_s_per_gb"] = summary([cpu for _, cpu in stack])
    cores = os.cpu_count() or 1
    # the whole path's ceiling: the stack's CPU plus three copies per byte, on every core, nothing else
    figures["end_to_end_bound_gbps"] = summary([cores / (cpu + 3 / figures["memcpy_gbps"]["median"]) for _, cpu in stack])

    token = secrets.token_hex(16)
    runs = iter(range(10_000))
    run_id = secrets.token_hex(3)  # job records persist in the data dir; never reuse a name
    window = args.cached_steps
    budget_mb = max(512, 3 * window * step_bytes >> 20)

    def node_figures(shm_parent: Path, prefix: str = "", only_cached: bool = False) -> None:
        with LocalCluster(args.work, ds_dir.parent, token, shm_parent=shm_parent) as cluster:
            ds = cluster.start_dataserver("--log-level", "warning")
            daemon = cluster.start_daemon("--window", str(window), "--log-level", "warning", budget_mb=budget_mb)

            def cached_read() -> float:
                job = f"cached-{run_id}-{next(runs)}"
                _create_job(ds.url, token, job, args.batch, args.cached_steps, seed=next(runs))
                loader = DataLoader(job, 0, dataserver=ds.url, token=token, socket_path=cluster.socket())
                batches = iter(loader)
                next(batches)  # the first request starts the prefetch of the whole (short) job
                _wait_cached(daemon.url, job, args.cached_steps)
                nbytes, secs = _consume(batches, args.batch, args.seq)
                loader.close()
                return nbytes / secs / GB

            def end_to_end() -> float:
                job = f"e2e-{run_id}-{next(runs)}"
                _create_job(ds.url, token, job, args.batch, args.steps, seed=next(runs))
                loader = DataLoader(job, 0, dataserver=ds.url, token=token, socket_path=cluster.socket())
                nbytes, secs = _consume(iter(loader), args.batch, args.seq)
                loader.close()
                return nbytes / secs / GB

            def control_rtt_us() -> float:
                """One worker↔daemon round trip for a step already cached (the per-batch control cost)."""
                from ffplane_contract.control import Get, Open
                from trainer_client._daemon_client import DaemonClient

                job = f"rtt-{run_id}-{next(runs)}"
                _create_job(ds.url, token, job, args.batch, 2, seed=0)
                client = DaemonClient(cluster.socket(), 60)
                client.call(Open(job, 0, token))
                client.call(Get(0))
                t = time.perf_counter()
                for _ in range(500):
                    client.call(Get(0))
                elapsed = time.perf_counter() - t
                client.close()
                return elapsed / 500 * 1e6

            figures[f"node_cache_read{prefix}_gbps"] = repeat(cached_read, args.repeats)
            if not only_cached:
                figures["control_rtt_us"] = repeat(control_rtt_us, args.repeats)
                figures["end_to_end_gbps"] = repeat(end_to_end, args.repeats)

    with huge_tmpfs(args.work / "shm-huge", budget_mb + 64, args.huge) as huge:
        shm_pages = "2 MiB (tmpfs huge=within_size)" if huge else "4 KiB (/dev/shm)"
        print(f"node cache root: {shm_pages}")
        node_figures(huge or Path("/dev/shm"))
    if huge:  # the same cached reads from a daemon on /dev/shm: what the page size is worth
        node_figures(Path("/dev/shm"), "_4k_pages", only_cached=True)

    from bench import _data_baselines as peers

    shards = sorted(str(s) for s in ds_dir.glob("shard-*.arrow"))
    # one epoch of the peers takes as long as the dataset; cap it to about what we read per repeat
    sub = _subset(shards, args.steps * args.batch, args.work)
    for workers in (0, 2):
        figures[f"torch_dataloader_local_{workers}w_gbps"] = repeat(
            lambda: peers.torch_dataloader_local_gbps(sub, args.batch, num_workers=workers), args.repeats
        )
    best = max((figures[f"torch_dataloader_local_{w}w_gbps"] for w in (0, 2)), key=lambda f: f["median"])
    figures["torch_dataloader_local_gbps"] = best
    if not args.no_mosaic:
        mds = args.work / f"mds-{len(sub)}"
        if not (mds / "index.json").exists():
            peers.write_mds(sub, str(mds))
        figures["mosaic_streaming_gbps"] = repeat(lambda: peers.mosaic_streaming_gbps(str(mds), args.batch, num_workers=2), args.repeats)

    f = figures
    checks: dict[str, Any] = {
        "node_cache_read_vs_memcpy": {"ratio": ratio(f["node_cache_read_gbps"], f["memcpy_gbps"]), "target": ">= 0.5"},
        "end_to_end_vs_loopback_tcp": {"ratio": ratio(f["end_to_end_gbps"], f["loopback_tcp_gbps"]), "target": ">= 0.7"},
        # what the stack alone reaches: no end-to-end path built on it can beat this ratio
        "http_stack_vs_loopback_tcp": {"ratio": ratio(f["http_stack_gbps"], f["loopback_tcp_gbps"]), "target": "(the stack alone)"},
        "end_to_end_bound_vs_loopback_tcp": {
            "ratio": ratio(f["end_to_end_bound_gbps"], f["loopback_tcp_gbps"]),
            "target": "(ceiling of end_to_end_vs_loopback_tcp)",
        },
        "end_to_end_vs_http_stack": {"ratio": ratio(f["end_to_end_gbps"], f["http_stack_gbps"]), "target": "(reported)"},
        "node_cache_read_vs_torch_local": {"ratio": ratio(f["node_cache_read_gbps"], f["torch_dataloader_local_gbps"]), "target": "> 1"},
        "end_to_end_vs_torch_local": {"ratio": ratio(f["end_to_end_gbps"], f["torch_dataloader_local_gbps"]), "target": "> 1"},
    }
    if "mosaic_streaming_gbps" in f:
        checks["node_cache_read_vs_mosaic"] = {"ratio": ratio(f["node_cache_read_gbps"], f["mosaic_streaming_gbps"]), "target": "> 1"}
        checks["end_to_end_vs_mosaic"] = {"ratio": ratio(f["end_to_end_gbps"], f["mosaic_streaming_gbps"]), "target": "> 1"}
    config = {
        "shm_pages": shm_pages,
        "gib": args.gib,
        "rows": rows,
        "seq": args.seq,
        "batch": args.batch,
        "step_bytes": step_bytes,
        "steps": args.steps,
        "cached_steps": args.cached_steps,
        "repeats": args.repeats,
        "peer_rows": args.steps * args.batch,
    }
    out = write_results(args.out, figures, config, checks, args.results_dir)

    base = f["memcpy_gbps"]
    print_table(
        [
            ("memcpy_gbps", f["memcpy_gbps"], "(machine limit)"),
            ("loopback_tcp_gbps", f["loopback_tcp_gbps"], "(machine limit)"),
            (
                "http_stack_gbps",
                f["http_stack_gbps"],
                f"{ratio(f['http_stack_gbps'], f['loopback_tcp_gbps']):.2f} x loopback TCP (FastAPI -> aiohttp alone)",
            ),
            ("http_stack_cpu_s_per_gb (CPU s/GB)", f["http_stack_cpu_s_per_gb"], "server + client together"),
            (
                "end_to_end_bound_gbps",
                f["end_to_end_bound_gbps"],
                f"{ratio(f['end_to_end_bound_gbps'], f['loopback_tcp_gbps']):.2f} x loopback TCP (all cores, stack + 3 copies, no other work)",
            ),
            ("node_cache_read_gbps", f["node_cache_read_gbps"], f"{ratio(f['node_cache_read_gbps'], base):.2f} x memcpy (target >= 0.5)"),
            *(
                [
                    (
                        "node_cache_read_4k_pages_gbps",
                        f["node_cache_read_4k_pages_gbps"],
                        f"{ratio(f['node_cache_read_4k_pages_gbps'], base):.2f} x memcpy (cache root on /dev/shm)",
                    )
                ]
                if "node_cache_read_4k_pages_gbps" in f
                else []
            ),
            (
                "end_to_end_gbps",
                f["end_to_end_gbps"],
                f"{ratio(f['end_to_end_gbps'], f['loopback_tcp_gbps']):.2f} x loopback TCP (target >= 0.7)",
            ),
            ("control_rtt_us (microseconds)", f["control_rtt_us"], "per batch, worker <-> daemon, Unix socket"),
            *[(k, v, "(baseline)") for k, v in f.items() if k.startswith("torch_dataloader_local_") and "w_" in k],
            *([("mosaic_streaming_gbps", f["mosaic_streaming_gbps"], "(baseline)")] if "mosaic_streaming_gbps" in f else []),
        ],
        "GB/s",
    )
    for name, c in checks.items():
        print(f"  {name:34s} {c['ratio']:7.2f}   target {c['target']}")
    bar_chart(
        args.results_dir / f"{args.out}.png",
        [(k, v) for k, v in f.items() if k.endswith("_gbps") and k != "torch_dataloader_local_gbps"],
        "GB/s (median, min-max)",
        "ffplane data path vs machine limits and peers",
    )
    print(f"wrote {out}")
    return {"figures": figures, "targets": checks}


def _subset(shards: list[str], rows: int, work: Path) -> list[str]:
    """Arrow shards holding the first ``rows`` rows (the peers read a whole epoch per repeat)."""
    out = work / f"peer-subset-{rows}.arrow"
    if not out.exists():
        got = 0
        with pa.ipc.open_file(pa.memory_map(shards[0])) as first:
            schema = first.schema
        with pa.ipc.new_file(str(out), schema) as w:
            for path in shards:
                r = pa.ipc.open_file(pa.memory_map(path))
                for i in range(r.num_record_batches):
                    b = r.get_batch(i).slice(0, rows - got)
                    w.write_batch(b)
                    got += len(b)
                    if got >= rows:
                        break
                if got >= rows:
                    break
    return [str(out)]


if __name__ == "__main__":
    main()
