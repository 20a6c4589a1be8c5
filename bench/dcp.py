"""DCP through ffplane: the same FSDP2 state saved and loaded by every way a DCP trainer has.

    python bench/dcp.py                              # 384 MiB of state over 2 ranks, 5 repeats (~3 min)
    python bench/dcp.py --state-mib 96 --repeats 2   # smoke size

A 2-rank FSDP2 job (torchrun, CPU/gloo) holds an MLP's sharded weights and AdamW moments
(``--state-mib`` in all). Measured in one run, each the slowest rank's wall time per call (a
save is done when every rank's part is), after one warm-up call:

* ``checkpointer_save_s`` — ``Checkpointer.save`` of the sharded state (the baseline the target names);
* ``dcp_protocol_floor_s`` — ``dcp.save`` through a writer that writes nothing: DCP's own
  protocol (local plans, gather to the coordinator, scatter, gather of the results, broadcast),
  the floor under every storage writer, measured in the same run;
  ``dcp_protocol_floor_committing_s`` — the same while the daemon commits a shard of the same
  size (a ``Checkpointer.save`` just posted), as it does while ``dcp.save`` finishes;
* ``dcp_ffplane_save_s`` / ``dcp_ffplane_async_save_s`` — ``dcp.save`` / ``dcp.async_save`` with
  ``trainer_client.dcp.DaemonWriter`` (async: until the call returns; its staging is the blocking part);
  ``dcp_ffplane_save_cached_plan_s`` — ``dcp.save`` with ``DefaultSavePlanner(enable_plan_caching=True)``;
  ``dcp_ffplane_save_no_dist_s`` — ``dcp.save(..., no_dist=True)`` after full saves: the writer
  commits each rank's part of the last full save's plan, with no DCP collectives (steady state);
* ``dcp_filesystem_shm_save_s`` / ``..._async_save_s`` — the same with ``FileSystemWriter`` to /dev/shm
  (async with DCP's default stager: without CUDA there is no pinned memory to stage into);
* restores into the live sharded state: ``Checkpointer.restore(into=)``, ``dcp.load`` with
  ``DaemonReader``, ``dcp.load`` with ``FileSystemReader`` from /dev/shm.

Between two timed saves each rank waits for the last save to finish (its commit, an async save's
future) outside the timer, as a training step's compute would cover it.

Targets (issue 17): DCP through ffplane blocks <= 1.5x ``Checkpointer.save`` and >= 5x less than
``FileSystemWriter`` to /dev/shm. ``dcp.save`` also gets the ratio with DCP's protocol floor
(while the daemon commits) taken off: the part ffplane's writer owns. Results: ``bench/results/dcp.json`` and ``dcp.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, bar_chart, print_table, ratio, summary, write_results  # noqa: E402
from ffplane_harness.local_cluster import LocalCluster  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run(state_mib: int, repeats: int, work: Path) -> tuple[dict[str, Any], int]:
    shm = Path(tempfile.mkdtemp(prefix="ffplane-bench-dcp-", dir="/dev/shm"))
    try:
        (work / "data").mkdir(exist_ok=True)
        with LocalCluster(work, work / "data", secrets.token_hex(16)) as cluster:
            cluster.start_dataserver()
            cluster.start_daemon(budget_mb=max(1024, state_mib * 8))
            out = work / "ranks.json"
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_port()),
                   "-m", "bench._dcp_job", str(cluster.socket()), str(shm), str(out), str(state_mib), str(repeats)]  # fmt: skip
            subprocess.run(cmd, env=env, cwd=ROOT, check=True, timeout=1800)
        ranks = json.loads(out.read_text())
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    names = ranks[0]["times"].keys()
    slowest = {n: [max(r["times"][n][i] for r in ranks) for i in range(repeats)] for n in names}
    return {n: summary(v) for n, v in slowest.items()}, sum(int(r["local_bytes"]) for r in ranks)


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-mib", type=int, default=384)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="dcp")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ffplane-bench-dcp-") as tmp:
        figures, state_bytes = run(args.state_mib, args.repeats, Path(tmp))
    base = figures["checkpointer_save_s"]
    fs = figures["dcp_filesystem_shm_save_s"]
    rows = [(n, f, f"{ratio(f, base):.2f}x Checkpointer.save" if "save" in n else "") for n, f in figures.items()]
    print(f"state: {state_bytes / 2**20:.0f} MiB over 2 ranks (seconds per call, slowest rank)")
    print_table(rows, "s")
    checks = {
        "dcp_save_vs_checkpointer_save": {"ratio": ratio(figures["dcp_ffplane_save_s"], base), "target": "<= 1.5"},
        "dcp_save_less_protocol_floor_vs_checkpointer_save": {
            "ratio": (figures["dcp_ffplane_save_s"]["median"] - figures["dcp_protocol_floor_committing_s"]["median"]) / base["median"],
            "target": "<= 1.5",
        },
        "dcp_save_cached_plan_vs_checkpointer_save": {"ratio": ratio(figures["dcp_ffplane_save_cached_plan_s"], base), "target": "<= 1.5"},
        "dcp_save_no_dist_vs_checkpointer_save": {"ratio": ratio(figures["dcp_ffplane_save_no_dist_s"], base), "target": "<= 1.5"},
        "filesystem_shm_vs_dcp_save_no_dist": {"ratio": ratio(fs, figures["dcp_ffplane_save_no_dist_s"]), "target": ">= 5"},
        "dcp_async_save_vs_checkpointer_save": {"ratio": ratio(figures["dcp_ffplane_async_save_s"], base), "target": "<= 1.5"},
        "filesystem_shm_vs_dcp_save": {"ratio": ratio(fs, figures["dcp_ffplane_save_s"]), "target": ">= 5"},
        "filesystem_shm_async_vs_dcp_async_save": {
            "ratio": ratio(figures["dcp_filesystem_shm_async_save_s"], figures["dcp_ffplane_async_save_s"]),
            "target": ">= 5",
        },
    }
    for k, v in checks.items():
        print(f"{k}: {v['ratio']:.2f} (target {v['target']})")
    write_results(
        args.out,
        figures,
        {"state_bytes": state_bytes, "ranks": 2, "repeats": args.repeats, "command": " ".join(sys.argv)},
        checks,
        args.results_dir,
    )
    bar_chart(
        args.results_dir / f"{args.out}.png",
        list(figures.items()),
        "seconds per call (slowest rank)",
        f"DCP, {state_bytes / 2**20:.0f} MiB FSDP2 state, 2 ranks",
    )
    return {"figures": figures, "checks": checks}


if __name__ == "__main__":
    main()
