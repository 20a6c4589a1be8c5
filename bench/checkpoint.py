"""Checkpoint cost: ffplane's save/restore beside a bare copy and the savers users have today.

    python bench/checkpoint.py                       # 64 MiB, 512 MiB, 2 GiB; 3 repeats (~5 min)
    python bench/checkpoint.py --sizes-mb 16 --repeats 1 --no-dlrover   # smoke size

For each state size (fp32 tensors plus a bf16 and an int64 one, as a model + optimizer state
would hold), measured in one run:

* ``save_block_s`` — ``Checkpointer.save``'s blocking part (slots allocated by a warm-up save);
* ``memcpy_s`` — a bare copy of the same tensors into pre-faulted memory (the floor);
* ``torch_save_shm_s`` / ``torch_save_disk_s`` — ``torch.save`` to /dev/shm and to disk (+fsync);
* ``dcp_async_save_block_s`` — ``torch.distributed.checkpoint.async_save`` until it returns;
* ``restore_s`` — ``Checkpointer.restore(into=live_tensors)`` incl. the daemon's checksum check;
* ``torch_load_shm_s`` — ``torch.load(mmap=True)`` from /dev/shm, copied into the live tensors;
* ``dlrover_flash_save_block_s`` — DLRover flash checkpoint, memory mode, where it installs.

Torch runs one intra-op thread for every system, so all copies are single-threaded alike.
Results: ``bench/results/checkpoint.json`` and ``checkpoint.png``.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, bar_chart, huge_tmpfs, ratio, repeat, write_results  # noqa: E402
from ffplane_harness.local_cluster import LocalCluster  # noqa: E402
from trainer_client import Checkpointer  # noqa: E402


def make_state(nbytes: int) -> dict[str, Any]:
    """~``nbytes`` of state: 16 fp32 matrices, a bf16 and an int64 tensor, a few JSON leaves."""
    per = nbytes // 18 // 4
    g = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(16)}
    model["emb.bf16"] = torch.randn(per * 2, generator=g).to(torch.bfloat16)
    return {"model": model, "optim": {"step_counts": torch.arange(per // 2, dtype=torch.int64)}, "step": 0, "lr": 3e-4}


def tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in tensors(v)]
    return []


def like(state: Any) -> Any:
    """Same structure, separate pre-faulted tensors (the 'live' state a restore copies into)."""
    if isinstance(state, torch.Tensor):
        out = torch.empty_like(state)
        out.copy_(state)
        return out
    if isinstance(state, dict):
        return {k: like(v) for k, v in state.items()}
    return state


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_size(nbytes: int, socket: Path, repeats: int, work: Path, dlrover: bool) -> dict[str, Any]:
    state = make_state(nbytes)
    src = tensors(state)
    real = sum(t.numel() * t.element_size() for t in src)
    live = like(state)
    dst = tensors(live)
    out: dict[str, Any] = {"state_bytes": real}

    out["memcpy_s"] = repeat(lambda: timed(lambda: [d.copy_(s) for d, s in zip(dst, src)]), repeats)

    job = f"ckpt-{nbytes >> 20}-{secrets.token_hex(2)}"
    ck = Checkpointer(job, socket_path=socket)
    ck.save(0, state)  # allocates and pre-faults the slots once
    ck.wait()
    steps = iter(range(1, 1000))

    def save() -> float:
        ck.wait()
        return timed(lambda: ck.save(next(steps), state))

    out["save_block_s"] = repeat(save, repeats)
    ck.wait()

    def restore() -> float:
        fresh = Checkpointer(job, socket_path=socket)  # as a restarted worker would
        try:
            return timed(lambda: fresh.restore(into=live))
        finally:
            fresh.close()  # its mappings of the slots, too

    out["restore_s"] = repeat(restore, repeats)
    assert all(torch.equal(a, b) for a, b in zip(dst, src)), "restore returned wrong bytes"
    ck.close()

    shm_file = Path("/dev/shm") / f"ffplane-bench-{os.getpid()}.pt"
    disk_file = work / "torch-save.pt"

    def torch_save(path: Path, sync: bool) -> float:
        path.unlink(missing_ok=True)
        t = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        return time.perf_counter() - t

    try:
        out["torch_save_shm_s"] = repeat(lambda: torch_save(shm_file, False), repeats)

        def torch_load() -> float:
            t = time.perf_counter()
            loaded = torch.load(shm_file, mmap=True, weights_only=True)
            for d, s in zip(dst, tensors(loaded)):
                d.copy_(s)  # touch every byte: mmap=True alone is lazy
            return time.perf_counter() - t

        out["torch_load_shm_s"] = repeat(torch_load, repeats)
    finally:
        shm_file.unlink(missing_ok=True)
    out["torch_save_disk_s"] = repeat(lambda: torch_save(disk_file, True), repeats)
    disk_file.unlink(missing_ok=True)
    out["dcp_async_save_block_s"] = _dcp(state, work, repeats)
    if dlrover:
        out.update(_dlrover(state, work, repeats))
    return out


def _dcp(state: dict[str, Any], work: Path, repeats: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{work / 'pg'}", rank=0, world_size=1)
    runs = iter(range(10_000))

    def one() -> float:
        d = work / f"dcp-{next(runs)}"
        t = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=str(d))
        block = time.perf_counter() - t
        (fut.result() if hasattr(fut, "result") else fut.upload_completion.result())
        shutil.rmtree(d, ignore_errors=True)
        return block

    one()  # the first call sets up the background machinery (seconds); users pay it once
    return repeat(one, repeats)


def _dlrover(state: dict[str, Any], work: Path, repeats: int) -> dict[str, Any]:
    try:
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType  # type: ignore[import-not-found]
    except Exception as exc:  # noqa: BLE001 - any failure to import is the finding
        return {"dlrover_flash_save_block_s": None, "dlrover_note": f"not measured: import failed: {exc!r}"[:300]}
    before = set(Path("/dev/shm").glob("ckpt_*")) | set(Path("/tmp").glob("ckpt_*"))
    try:
        ckpt = DdpCheckpointer(str(work / "dlrover"))
        steps = iter(range(1, 10_000))
        ckpt.save_checkpoint(0, state, storage_type=StorageType.MEMORY)
        res = repeat(lambda: timed(lambda: ckpt.save_checkpoint(next(steps), state, storage_type=StorageType.MEMORY)), repeats)
        return {
            "dlrover_flash_save_block_s": res,
            "dlrover_note": "DdpCheckpointer.save_checkpoint(MEMORY), standalone (no dlrover-run agent)",
        }
    except Exception as exc:  # noqa: BLE001
        return {"dlrover_flash_save_block_s": None, "dlrover_note": f"not measured: {exc!r}"[:300]}
    finally:  # DLRover leaves its shared memory and socket behind
        for leftover in (set(Path("/dev/shm").glob("ckpt_*")) | set(Path("/tmp").glob("ckpt_*"))) - before:
            shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", default="64,512,2048")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-dlrover", action="store_true")
    p.add_argument(
        "--huge",
        choices=["auto", "off"],
        default="auto",
        help="auto: the daemon's root on a tmpfs mounted huge=within_size (needs root; the recommended "
        "deployment, docs/deployment.md); off: /dev/shm",
    )
    p.add_argument("--out", default="checkpoint")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    sizes = [int(s) << 20 for s in args.sizes_mb.split(",")]
    figures: dict[str, Any] = {}
    checks: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ffplane-ckpt-bench-", dir="/tmp") as tmp:
        work = Path(tmp)
        (work / "data").mkdir()
        # one daemon per size, its root removed after: a role keeps 4 pre-faulted slots (three
        # committed versions and the one being written), 8 GiB for the 2 GiB state alone
        budget_mb = max(4 * max(sizes) * 11 // 10 >> 20, 256)
        with huge_tmpfs(work / "shm-huge", 2 * budget_mb, args.huge) as huge:  # a cap, not a reservation
            shm_pages = "2 MiB (tmpfs huge=within_size)" if huge else "4 KiB (/dev/shm)"
            print(f"daemon root: {shm_pages}; the torch.save baselines write to /dev/shm")
            for size in sizes:
                name = f"{size >> 20}MiB"
                print(f"--- state {name}")
                with LocalCluster(work, work / "data", secrets.token_hex(16), shm_parent=huge or Path("/dev/shm")) as cluster:
                    cluster.start_dataserver("--log-level", "warning")
                    cluster.start_daemon("--log-level", "warning", budget_mb=budget_mb)
                    f = figures[name] = bench_size(size, cluster.socket(), args.repeats, work, not args.no_dlrover)
                checks[name] = {
                    "save_block_vs_memcpy": {"ratio": ratio(f["save_block_s"], f["memcpy_s"]), "target": "<= 1.5"},
                    "torch_save_shm_vs_save_block": {"ratio": ratio(f["torch_save_shm_s"], f["save_block_s"]), "target": ">= 10"},
                    "restore_vs_memcpy": {"ratio": ratio(f["restore_s"], f["memcpy_s"]), "target": "<= 2"},
                }
                for k, v in f.items():
                    if isinstance(v, dict):
                        print(f"  {k:28s} min {v['min']:.4f}  median {v['median']:.4f}  max {v['max']:.4f} s")
                    elif v is not None:
                        print(f"  {k:28s} {v}")
                for k, c in checks[name].items():
                    print(f"  {k:32s} {c['ratio']:8.2f}   target {c['target']}")
    import torch.distributed as dist

    if dist.is_initialized():  # created by the DCP baseline
        dist.destroy_process_group()
    out = write_results(
        args.out,
        figures,
        {"sizes_mb": args.sizes_mb, "repeats": args.repeats, "torch_threads": 1, "daemon_root_pages": shm_pages},
        checks,
        args.results_dir,
    )
    rows = [
        (f"{n} {k.removesuffix('_s')}", v)
        for n, f in figures.items()
        for k, v in f.items()
        if isinstance(v, dict) and k in ("save_block_s", "memcpy_s", "torch_save_shm_s", "dcp_async_save_block_s", "restore_s")
    ]
    bar_chart(args.results_dir / f"{args.out}.png", rows, "seconds (median, min-max)", "checkpoint: ffplane vs copy floor and peers")
    print(f"wrote {out}")
    return {"figures": figures, "targets": checks}


if __name__ == "__main__":
    main()
