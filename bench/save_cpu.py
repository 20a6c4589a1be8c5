"""The CPU one ``Checkpointer.save`` costs, thread by thread, against its floor (copy + checksum).

    python bench/save_cpu.py                         # cnn state (4 MiB), 600 saves x 3 repeats (~15 s)
    python bench/save_cpu.py --saves 20 --repeats 1  # smoke size

bench/overhead.py's CNN loop keeps both cores busy, so every CPU-millisecond a save costs anywhere
(the training thread, any other thread of the worker, the daemon) is about a millisecond of step
time.
This probe saves the same state (``overhead.Loop("cnn")``'s model + AdamW state) with no
training beside it, only ``--gap-ms`` of busy-looping between saves (a training thread computes
between saves; one blocked on the daemon's socket instead would make each reply cost a wake-up),
and reads ``/proc`` CPU times per thread:

* ``save_ms`` — the training thread's CPU in ``save()`` (reading the previous commit's reply,
  the encode walk, the copy, sending the commit);
* ``worker_other_ms`` — the worker's other Python threads (ffplane's copy threads; a commit
  thread, in versions that had one);
* ``torch_threads_ms`` — torch's intra-op threads, reported apart and not in ``total_ms``: they
  split large ``copy_`` calls but also spin-wait after every parallel region (~4 ms of CPU per
  save here with 3 ms gaps), which /proc cannot tell apart, and in training they are busy anyway;
* ``daemon_loop_ms`` — the daemon's event loop thread; ``daemon_other_ms`` — its other threads
  (large shards are checksummed on one);
* ``total_ms`` — all of the above, per save.

Baseline in the same run: ``floor_ms`` = one copy of the same bytes into pre-faulted memory plus
one XXH3 checksum of them (what a save cannot avoid). Results: ``bench/results/save_cpu.json``.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, cpu_by_thread, print_table, ratio, summary, write_results  # noqa: E402
from bench.overhead import Loop  # noqa: E402
from ffplane_harness.local_cluster import LocalCluster  # noqa: E402
from statestore.protocol.checksum import checksum  # noqa: E402
from trainer_client import Checkpointer  # noqa: E402
from trainer_client.state_codec import encode  # noqa: E402


def _floor_ms(nbytes: int, times: int) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.fill_(1)  # pre-faulted, as a slot is
    t0 = time.thread_time()
    for _ in range(times):
        dst.copy_(src)
        checksum(dst.numpy().data)
    return (time.thread_time() - t0) / times * 1e3


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _run(ck: Checkpointer, loop: Loop, daemon_pid: int, saves: int, first: int, gap_s: float) -> dict[str, float]:
    me = threading.get_native_id()
    ck.save(first, loop.state(first))
    ck.wait()
    client0, daemon0 = cpu_by_thread(os.getpid()), cpu_by_thread(daemon_pid)
    save_s = 0.0
    for i in range(1, saves + 1):
        state = loop.state(first + i)  # the caller's state_dict() calls are not the save's cost
        t = time.thread_time()
        ck.save(first + i, state)
        save_s += time.thread_time() - t
        _spin(gap_s)
    t = time.thread_time()
    ck.wait()
    save_s += time.thread_time() - t  # the last commit's reply
    client1, daemon1 = cpu_by_thread(os.getpid()), cpu_by_thread(daemon_pid)

    def delta(before: dict[int, float], after: dict[int, float], keep: Any) -> float:
        return sum(v - before.get(tid, 0.0) for tid, v in after.items() if keep(tid))

    python_threads = {t.native_id for t in threading.enumerate()}
    per = {
        "save_ms": save_s,
        "worker_other_ms": delta(client0, client1, lambda tid: tid != me and tid in python_threads),
        "daemon_loop_ms": delta(daemon0, daemon1, lambda tid: tid == daemon_pid),
        "daemon_other_ms": delta(daemon0, daemon1, lambda tid: tid != daemon_pid),
    }
    per = {k: v / saves * 1e3 for k, v in per.items()}
    per["total_ms"] = sum(per.values())
    per["torch_threads_ms"] = delta(client0, client1, lambda tid: tid not in python_threads) / saves * 1e3
    return per


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--saves", type=int, default=600)
    p.add_argument("--gap-ms", type=float, default=3.0, help="busy-looping between saves")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--copy-threads", type=int, default=None, help="Checkpointer copy_threads (default: its own)")
    p.add_argument("--out", default="save_cpu")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    loop = Loop("cnn", 0)
    loop.step()  # AdamW state exists
    samples: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="ffplane-save-cpu-", dir="/tmp") as tmp:
        work = Path(tmp)
        (work / "data").mkdir()
        with LocalCluster(work, work / "data", secrets.token_hex(16)) as cluster:
            cluster.start_dataserver("--log-level", "warning")
            daemon = cluster.start_daemon("--log-level", "warning", budget_mb=256)
            ck = Checkpointer("save-cpu", socket_path=cluster.socket(), copy_threads=args.copy_threads)
            try:
                step = 0
                for _ in range(args.repeats):
                    for k, v in _run(ck, loop, daemon.pid, args.saves, step, args.gap_ms / 1e3).items():
                        samples.setdefault(k, []).append(v)
                    step += args.saves + 1
            finally:
                ck.close()
    enc = encode(loop.state(0))
    nbytes = sum(enc.stream_nbytes.values())
    samples["floor_ms"] = [_floor_ms(nbytes, max(20, args.saves // 4)) for _ in range(args.repeats)]
    figures = {k: summary(v) for k, v in samples.items()}
    checks = {
        "total_vs_floor": {
            "ratio": ratio(figures["total_ms"], figures["floor_ms"]),
            "target": "(reported: 1.0 would be a save that only copies and checksums)",
        }
    }
    out = write_results(
        args.out,
        figures,
        {"saves": args.saves, "gap_ms": args.gap_ms, "repeats": args.repeats, "state_bytes": nbytes, "copy_threads": args.copy_threads},
        checks,
        args.results_dir,
    )
    print_table([(k, v, "") for k, v in figures.items()], "CPU ms per save")
    print(f"  total / floor {checks['total_vs_floor']['ratio']:.2f}")
    print(f"wrote {out}")
    return {"figures": figures, "targets": checks}


if __name__ == "__main__":
    main()
