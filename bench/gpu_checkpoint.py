"""GPU checkpoint cost: ffplane's device → slot save and slot → device restore beside the bare
pinned copies of the same bytes (the limit) and the savers users have today.

    python bench/gpu_checkpoint.py                          # on a GPU: 1, 4 and 16 GiB of CUDA state (~10 min)
    python bench/gpu_checkpoint.py --device cpu --sizes-mb 16 --repeats 1    # the script's logic, on CPU

For each size of CUDA state per process (bf16 weights and fp32 optimizer-like tensors), in one run:

* ``bare_d2h_s`` — one ``cudaMemcpyAsync`` per tensor into page-locked (registered) host memory,
  on a side stream, then synchronize: the limit for a save;
* ``save_block_s`` — ``Checkpointer.save`` blocking mode (its copy done when it returns), once
  each of the role's 4 slots has been saved into (``first_saves_block_s``: those first saves,
  which also page-lock their slot);
* ``overlapped_save_block_s`` — overlapped mode: ``save`` plus the optimizer step's wait for the copy;
* ``step_s`` / ``step_overlapped_s`` — a training step of ~0.5 s (matmuls, then an SGD step over the
  saved tensors) without saves, and with an overlapped save after every step;
* ``torch_save_shm_s`` — ``torch.save`` of the CUDA state to /dev/shm;
* ``dcp_async_save_block_s`` — ``torch.distributed.checkpoint.async_save`` with pinned staging
  (``DefaultStager``, synchronous staging) until it returns;
* ``bare_h2d_s`` / ``restore_s`` — a bare pinned host → device copy, and ``Checkpointer.restore(
  into=cuda_state)`` (the daemon's checksum check included);
* ``map_populate_s``, ``register_s``, ``unregister_s``, ``pageable_h2d_s`` — a restore's parts
  from a fresh process: mapping a shard-sized file on the daemon's tmpfs and faulting it in,
  page-locking and unlocking it, and the device copy from it unlocked.

Targets (issue 19): save_block ≤ 1.2× bare_d2h; overlapped steps ≤ 1.02× plain ones; torch.save ≥ 10×
save_block; restore ≤ 1.5× bare_h2d. Results: ``bench/results/gpu_checkpoint.json`` (``--device cpu``
writes ``gpu_checkpoint_cpu.json``: a check of the script, not a GPU figure).
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, huge_tmpfs, ratio, repeat, summary, write_results  # noqa: E402
from ffplane_harness.local_cluster import LocalCluster  # noqa: E402
from statestore.retention import DEFAULT_VERSIONS as SLOTS  # noqa: E402  (slots per role, settled saves)
from trainer_client import Checkpointer  # noqa: E402
from trainer_client._device_copy import copy_now  # noqa: E402
from trainer_client._restore import map_file  # noqa: E402
from trainer_client.pinned import Registration  # noqa: E402

_CHUNK = 256 << 20  # bytes per saved tensor (a large layer's weights)


def make_state(nbytes: int, device: str) -> dict[str, torch.Tensor]:
    """~``nbytes`` of tensors on ``device``: a third bf16 weights, the rest fp32 moments."""
    out: dict[str, torch.Tensor] = {}
    left, i = nbytes, 0
    chunk = min(_CHUNK, max(nbytes // 6, 1 << 20))  # at least six tensors at small sizes
    while left > 0:
        n = min(chunk, left)
        dtype = torch.bfloat16 if i % 3 == 0 else torch.float32
        out[f"t{i}"] = torch.randn(n // dtype.itemsize, device=device, dtype=torch.float32).to(dtype)
        left -= n
        i += 1
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(device: str, fn: Callable[[], object]) -> float:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def host_copy(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for d, s in pairs:
        d.copy_(s)


def bare_copies(state: dict[str, torch.Tensor], device: str, repeats: int) -> dict[str, Any]:
    """The limit: the same bytes into (out of) one registered host buffer, one copy per tensor."""
    flat = [t.view(-1).view(torch.uint8) for t in state.values()]
    host = torch.empty(sum(t.numel() for t in flat), dtype=torch.uint8)
    host.fill_(0)  # faulted in, as a slot is
    pin = Registration(host)
    parts, at = [], 0
    for t in flat:
        parts.append(host[at : at + t.numel()])
        at += t.numel()
    try:
        d2h = repeat(lambda: timed(device, lambda: copy_now(list(zip(parts, flat)), host_copy)), repeats)
        h2d = repeat(lambda: timed(device, lambda: copy_now(list(zip(flat, parts)), host_copy)), repeats)
    finally:
        pin.release()
    return {"bare_d2h_s": d2h, "bare_h2d_s": h2d, "host_pinned": pin.nbytes if device == "cuda" else 0}


def restore_parts(state: dict[str, torch.Tensor], device: str, where: Path, repeats: int) -> dict[str, Any]:
    """What a restore from a fresh process pays before its copies, on the daemon's tmpfs: mapping
    a shard (shared, read-only) and faulting it in, page-locking it and unlocking it; and the
    copy onto the device from the same mapping unlocked (pageable), the alternative to locking."""
    path = where / f"bench-restore-parts-{secrets.token_hex(3)}"
    with open(path, "wb") as f:
        for t in state.values():
            f.write(t.view(-1).view(torch.uint8).cpu().numpy())
    sizes = [t.numel() * t.element_size() for t in state.values()]
    parts: dict[str, list[float]] = {"map_populate_s": [], "register_s": [], "unregister_s": [], "pageable_h2d_s": []}
    try:
        flat = [t.view(-1).view(torch.uint8) for t in state.values()]
        for _ in range(repeats):
            t = time.perf_counter()
            host = map_file(path, shared_read_only=True)
            parts["map_populate_s"].append(time.perf_counter() - t)
            views, at = [], 0
            for n in sizes:
                views.append(host[at : at + n])
                at += n
            pairs = list(zip(flat, views))
            parts["pageable_h2d_s"].append(timed(device, lambda: copy_now(pairs, host_copy)))
            t = time.perf_counter()
            pin = Registration(host, read_only=True)
            parts["register_s"].append(time.perf_counter() - t)
            t = time.perf_counter()
            pin.release()
            parts["unregister_s"].append(time.perf_counter() - t)
    finally:
        path.unlink(missing_ok=True)
    return {k: summary(v) for k, v in parts.items()}


def step_times(state: dict[str, torch.Tensor], device: str, socket: Path, repeats: int, steps: int) -> dict[str, Any]:
    """Steps of ~0.5 s (matmuls, then SGD over the saved tensors) without and with overlapped saves."""
    params = [torch.nn.Parameter(t) for t in state.values() if t.dtype == torch.float32]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.SGD(params, lr=0.0)  # lr 0: the bytes stay comparable; the step still writes them
    a = torch.randn(4096 if device == "cuda" else 512, 4096 if device == "cuda" else 512, device=device)

    def compute(n: int) -> None:
        x = a
        for _ in range(n):
            x = torch.tanh(x @ a)

    n = 1
    while timed(device, lambda: compute(n)) < 0.5 and n < 1 << 16:  # calibrate to ~0.5 s
        n *= 2
    saved = {f"p{i}": p for i, p in enumerate(params)}

    def run(ckpt: Checkpointer | None) -> float:
        sync(device)
        t = time.perf_counter()
        for step in range(steps):
            compute(n)
            opt.step()
            if ckpt is not None:
                ckpt.save(step, saved)
        sync(device)
        return (time.perf_counter() - t) / steps

    run(None)  # warm-up: kernels loaded, the optimizer's buffers made
    plain = repeat(lambda: run(None), repeats)
    ckpt = Checkpointer(f"overlap-{secrets.token_hex(2)}", socket_path=socket, overlap_with=opt)
    for _ in range(-(-SLOTS // steps)):  # every slot allocated, pinned and pre-faulted once
        run(ckpt)
    waits: list[float] = []
    blocks: list[float] = []

    def overlapped() -> float:
        per_step = run(ckpt)
        waits.append(ckpt.last_overlap_wait_s)
        blocks.append(ckpt.last_save_block_s + ckpt.last_overlap_wait_s)
        return per_step

    with_saves = repeat(overlapped, repeats)
    ckpt.close()
    return {
        "step_s": plain,
        "step_overlapped_s": with_saves,
        "overlapped_save_block_s": summary(blocks),
        "compute_matmuls": n,
    }


def _progress(start: float, what: str) -> None:
    print(f"  {time.perf_counter() - start:7.1f} s  {what}", flush=True)


def bench_size(state: dict[str, torch.Tensor], device: str, socket: Path, repeats: int, work: Path, start: float) -> dict[str, Any]:
    """Everything but the training steps, against the daemon at ``socket``."""
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    out: dict[str, Any] = {"state_bytes": sum(t.numel() * t.element_size() for t in state.values())}
    _progress(start, "bare pinned copies")
    out.update(bare_copies(state, device, repeats))
    _progress(start, "torch.save to /dev/shm")

    shm_file = Path("/dev/shm") / f"ffplane-gpu-bench-{secrets.token_hex(3)}.pt"
    try:
        out["torch_save_shm_s"] = repeat(lambda: timed(device, lambda: torch.save(state, shm_file)), repeats)
    finally:
        shm_file.unlink(missing_ok=True)
    _progress(start, "DCP async_save")
    try:
        out["dcp_async_save_block_s"] = _dcp(state, device, work, repeats, pinned_stager=True)
        out["dcp_staging"] = "DefaultStager, pinned"
    except Exception as e:  # torch 2.11's stager fails to copy CUDA tensors (KeyError: <class 'type'>)
        print(f"  DCP with a pinned DefaultStager failed ({type(e).__name__}: {e}); measuring its default staging", flush=True)
        out["dcp_async_save_block_s"] = _dcp(state, device, work, repeats, pinned_stager=False)
        out["dcp_staging"] = f"async_save's default (DefaultStager failed: {type(e).__name__}: {e})"

    _progress(start, "Checkpointer.save")
    job = f"gpu-{nbytes >> 20}-{secrets.token_hex(2)}"
    ck = Checkpointer(job, socket_path=socket)
    first = []
    for step in range(SLOTS):  # each slot allocated, pinned and pre-faulted once: steady state after
        ck.wait()
        first.append(timed(device, lambda: ck.save(step, state)))
    out["first_saves_block_s"] = summary(first)
    ck.wait()
    steps_iter = iter(range(SLOTS, 1000))

    def save() -> float:
        ck.wait()
        return timed(device, lambda: ck.save(next(steps_iter), state))

    out["save_block_s"] = repeat(save, repeats)
    ck.wait()
    live = {k: torch.empty_like(v) for k, v in state.items()}

    def restore() -> float:
        fresh = Checkpointer(job, socket_path=socket)  # as a restarted worker would
        try:
            return timed(device, lambda: fresh.restore(into=live))
        finally:
            fresh.close()

    _progress(start, "a restore's parts: map, page-lock, pageable copy")
    out.update(restore_parts(state, device, socket.parent, repeats))
    _progress(start, "Checkpointer.restore")
    out["restore_s"] = repeat(restore, repeats)
    assert all(torch.equal(live[k], state[k]) for k in state), "restore returned wrong bytes"
    ck.close()
    return out


@contextlib.contextmanager
def _daemon(work: Path, huge: Path | None, budget_mb: int) -> Iterator[Path]:
    """A data server and one node daemon on ``huge`` (else /dev/shm), stopped after: its socket."""
    with LocalCluster(work, work / "data", secrets.token_hex(16), shm_parent=huge or Path("/dev/shm")) as cluster:
        cluster.start_dataserver("--log-level", "warning")
        cluster.start_daemon("--log-level", "warning", budget_mb=budget_mb)
        yield cluster.socket()


def _dcp(state: dict[str, torch.Tensor], device: str, work: Path, repeats: int, pinned_stager: bool) -> dict[str, Any]:
    import shutil

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{work / 'pg'}", rank=0, world_size=1)
    cuda = device == "cuda"
    options = StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda)
    stager = DefaultStager(options) if pinned_stager else None
    runs = iter(range(10_000))

    def one() -> float:
        d = Path("/dev/shm") / f"ffplane-gpu-bench-dcp-{next(runs)}"
        sync(device)
        t = time.perf_counter()
        res = dcp.async_save(state, checkpoint_id=str(d), async_stager=stager)  # None: its default staging
        block = time.perf_counter() - t
        fut = getattr(res, "upload_completion", res)
        fut.result()
        shutil.rmtree(d, ignore_errors=True)
        return block

    one()  # the first call sets up the background machinery and the staging cache
    try:
        return repeat(one, repeats)
    finally:
        if stager:
            stager.close()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", default="1024,4096,16384")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="training steps per step-time sample")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--huge", choices=["auto", "off"], default="auto", help="the daemon's root on a huge-page tmpfs (needs root)")
    p.add_argument("--out", default=None)
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: this benchmark measures the GPU path (--device cpu checks the script on CPU)")
    out_name = args.out or ("gpu_checkpoint" if args.device == "cuda" else "gpu_checkpoint_cpu")
    sizes = [int(s) << 20 for s in args.sizes_mb.split(",")]
    figures: dict[str, Any] = {}
    checks: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ffplane-gpu-bench-", dir="/tmp") as tmp:
        work = Path(tmp)
        (work / "data").mkdir()
        budget_mb = max(4 * max(sizes) * 11 // 10 >> 20, 256)  # a role keeps 4 slots
        with huge_tmpfs(work / "shm-huge", 2 * budget_mb, args.huge) as huge:
            for size in sizes:
                name = f"{size >> 20}MiB"
                print(f"--- {args.device} state {name}", flush=True)
                start = time.perf_counter()
                state = make_state(size, args.device)
                with _daemon(work, huge, budget_mb) as socket:
                    f = figures[name] = bench_size(state, args.device, socket, args.repeats, work, start)
                _progress(start, "training steps, without and with overlapped saves (a daemon of their own)")
                with _daemon(work, huge, budget_mb) as socket:  # the saves' slots would not fit beside theirs at 16 GiB
                    f.update(step_times(state, args.device, socket, args.repeats, args.steps))
                _progress(start, "done")
                del state
                checks[name] = {
                    "save_block_vs_bare_d2h": {"ratio": ratio(f["save_block_s"], f["bare_d2h_s"]), "target": "<= 1.2"},
                    "overlapped_step_vs_plain": {"ratio": ratio(f["step_overlapped_s"], f["step_s"]), "target": "<= 1.02"},
                    "torch_save_vs_save_block": {"ratio": ratio(f["torch_save_shm_s"], f["save_block_s"]), "target": ">= 10"},
                    "restore_vs_bare_h2d": {"ratio": ratio(f["restore_s"], f["bare_h2d_s"]), "target": "<= 1.5"},
                }
                for k, v in f.items():
                    if isinstance(v, dict):
                        print(f"  {k:28s} min {v['min']:.4f}  median {v['median']:.4f}  max {v['max']:.4f} s", flush=True)
                for k, c in checks[name].items():
                    print(f"  {k:32s} {c['ratio']:8.3f}   target {c['target']}", flush=True)
    import torch.distributed as dist

    if dist.is_initialized():  # created by the DCP baseline
        dist.destroy_process_group()
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    config = {"sizes_mb": args.sizes_mb, "repeats": args.repeats, "steps": args.steps, "device": device_name, "huge": args.huge}
    written = write_results(out_name, figures, config, checks, args.results_dir)
    print(f"wrote {written}")
    return {"figures": figures, "targets": checks}


if __name__ == "__main__":
    main()
