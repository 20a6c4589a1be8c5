"""DALI fed from the node cache vs DALI reading the same JPEG files itself.

    python bench/dali.py                                   # 4,000 images, 3 repeats, CPU decoder (~3 min)
    python bench/dali.py --device gpu                      # the mixed (GPU) decoder, on a GPU machine
    python bench/dali.py --images 256 --repeats 1          # smoke size

The same JPEGs (``--size`` px, smooth content with noise, ~``--size``² × 0.3 bytes each), the same
pipeline after the input (decode, resize to 224², crop-mirror-normalise), the same batch size and
threads; only the input differs:

* ``cache_images_per_s`` — ``trainer_client.dali.CacheSource``: the job's batches from the node
  daemon's cache (``no_copy``: DALI reads the cached pages in place), in plan order; the daemon's
  window covers the whole job and every step is cached before the first epoch is timed;
* ``reader_images_per_s`` — ``fn.readers.file`` over the files on local disk (page cache warm),
  shuffled, the baseline DALI users have.

Each repeat reads one epoch, after a warm-up epoch (the cache filled, the files in the page cache).
Target (issue 19): cache ≥ 1.0× the reader. Results: ``bench/results/dali.json`` (``dali_gpu.json``
with ``--device gpu``).
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import secrets
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, ratio, summary, write_results  # noqa: E402
from dataserver.ingest import IngestConfig, ingest  # noqa: E402
from ffplane_harness.local_cluster import LocalCluster  # noqa: E402


def make_images(n: int, size: int, files: Path, arrow: Path) -> int:
    """``n`` JPEGs as files (``files/<i>.jpg``) and as an Arrow table (jpeg, label); their bytes."""
    from PIL import Image

    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size]
    blobs = []
    for i in range(n):
        base = (np.sin(xx / (7 + i % 13)) + np.cos(yy / (5 + i % 11))) * 60 + 128
        img = np.clip(base[..., None] + rng.normal(0, 12, (size, size, 3)), 0, 255).astype(np.uint8)
        out = io.BytesIO()
        Image.fromarray(img).save(out, format="JPEG", quality=90)
        blobs.append(out.getvalue())
        (files / f"{i}.jpg").write_bytes(blobs[-1])
    table = pa.table({"jpeg": pa.array(blobs, pa.binary()), "label": pa.array(np.arange(n) % 1000)})
    with pa.ipc.new_file(str(arrow), table.schema) as w:
        w.write_table(table, max_chunksize=1024)
    return sum(len(b) for b in blobs)


def augment(images: Any, device: str) -> Any:
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types

    images = fn.resize(images, resize_x=224, resize_y=224, device="cpu" if device == "cpu" else "gpu")
    return fn.crop_mirror_normalize(
        images, dtype=types.FLOAT, output_layout="CHW", mean=[124.0, 116.0, 104.0], std=[58.0, 57.0, 57.0], mirror=0
    )


def cache_pipeline(source: Any, batch: int, threads: int, device: str) -> Any:
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types
    from nvidia.dali import pipeline_def

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=0 if device == "gpu" else None)
    def pipe() -> Any:
        jpegs, labels = fn.external_source(source=source, num_outputs=2, batch=True, no_copy=True, dtype=[types.UINT8, types.INT64])
        images = fn.decoders.image(jpegs, device="mixed" if device == "gpu" else "cpu")
        return augment(images, device), labels

    return pipe()


def reader_pipeline(files: Path, n: int, batch: int, threads: int, device: str) -> Any:
    import nvidia.dali.fn as fn
    from nvidia.dali import pipeline_def

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=0 if device == "gpu" else None)
    def pipe() -> Any:
        jpegs, labels = fn.readers.file(
            files=[str(files / f"{i}.jpg") for i in range(n)], labels=[i % 1000 for i in range(n)], random_shuffle=True, seed=1
        )
        images = fn.decoders.image(jpegs, device="mixed" if device == "gpu" else "cpu")
        return augment(images, device), labels

    return pipe()


def run_epoch(outputs: Iterator[Any], batches: int) -> int:
    """Take ``batches`` pipeline outputs; the images they held."""
    return sum(len(next(outputs)[0]) for _ in range(batches))


def _wait_cached(daemon_url: str, job: str, first: int, end: int, timeout_s: float = 600) -> None:
    """Until the daemon holds every step of ``job`` in [first, end)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cache = json.loads(urllib.request.urlopen(daemon_url + "/v1/cache").read())
        held = {int(s) for st in cache["streams"] if st["job"] == job for s in st["steps"]}
        if set(range(first, end)) <= held:
            return
        time.sleep(0.1)
    raise TimeoutError(f"the daemon did not cache steps {first}..{end - 1} of {job} in {timeout_s} s")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=4000)
    p.add_argument("--size", type=int, default=256, help="image side in pixels")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="DALI worker threads (the machine's cores)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu", help="cpu: fn.decoders.image on CPU; gpu: the mixed decoder")
    p.add_argument("--out", default=None)
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    from trainer_client.dali import CacheSource, DaliLoader

    out_name = args.out or ("dali" if args.device == "cpu" else "dali_gpu")
    per_epoch = args.images // args.batch
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ffplane-dali-bench-", dir="/tmp") as tmp:
        work = Path(tmp)
        (work / "files").mkdir()
        t = time.perf_counter()
        jpeg_bytes = make_images(args.images, args.size, work / "files", work / "jpegs.arrow")
        print(f"{args.images} JPEGs of {args.size}px, {jpeg_bytes / args.images / 1024:.1f} KiB each ({time.perf_counter() - t:.0f} s)")
        ingest(IngestConfig([work / "jpegs.arrow"], work / "data" / "jpegs", progress=False))
        token = secrets.token_hex(16)
        with LocalCluster(work, work / "data", token) as cluster:
            ds = cluster.start_dataserver("--log-level", "warning")
            steps = per_epoch * (args.repeats + 1)
            # the whole job fits the window: every step is in the cache before an epoch is timed,
            # so the figure is DALI reading the node cache (filling it is the data path's cost,
            # bench/data_path.py; on a real node the data server runs on another host)
            daemon = cluster.start_daemon(
                "--log-level", "warning", "--window", str(steps), budget_mb=max(256, 3 * (args.repeats + 1) * jpeg_bytes >> 20)
            )
            body = {"name": "dali", "dataset": "jpegs", "dp": 1, "batch_per_rank": args.batch, "seed": 3, "max_steps": steps}
            headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
            urllib.request.urlopen(urllib.request.Request(ds.url + "/v1/jobs", json.dumps(body).encode(), headers)).read()

            source = CacheSource("dali", 0, columns=("jpeg", "label"), dataserver=ds.url, token=token, socket_path=cluster.socket())
            loader = DaliLoader(cache_pipeline(source, args.batch, args.threads, args.device), source)
            from_cache = iter(loader)
            reader = reader_pipeline(work / "files", args.images, args.batch, args.threads, args.device)
            reader.build()
            from_files = (reader.run() for _ in itertools.count())
            run_epoch(from_cache, per_epoch)  # warm-up: the cache filled, the pipelines' buffers grown
            run_epoch(from_files, per_epoch)

            epochs_done = itertools.count(1)  # the warm-up was the first

            def cached() -> float:
                _wait_cached(daemon.url, "dali", next(epochs_done) * per_epoch + 2, steps)  # DALI has read two ahead
                t = time.perf_counter()
                return run_epoch(from_cache, per_epoch) / (time.perf_counter() - t)

            def files() -> float:
                t = time.perf_counter()
                return run_epoch(from_files, per_epoch) / (time.perf_counter() - t)

            samples_cache: list[float] = []
            samples_files: list[float] = []
            for _ in range(args.repeats):  # interleaved: drift in the machine hits both alike
                samples_cache.append(cached())
                samples_files.append(files())
            figures["cache_images_per_s"] = summary(samples_cache)
            figures["reader_images_per_s"] = summary(samples_files)
            loader.close()
    checks = {"cache_vs_reader": {"ratio": ratio(figures["cache_images_per_s"], figures["reader_images_per_s"]), "target": ">= 1.0"}}
    for k, v in figures.items():
        print(f"  {k:22s} min {v['min']:8.1f}  median {v['median']:8.1f}  max {v['max']:8.1f} images/s")
    print(f"  cache / reader         {checks['cache_vs_reader']['ratio']:.3f}   target >= 1.0")
    config = {k: getattr(args, k) for k in ("images", "size", "batch", "threads", "repeats", "device")}
    config["jpeg_kib"] = round(jpeg_bytes / args.images / 1024, 1)
    written = write_results(out_name, figures, config, checks, args.results_dir)
    print(f"wrote {written}")
    return {"figures": figures, "targets": checks}


if __name__ == "__main__":
    main()
