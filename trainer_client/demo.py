"""``ffplane demo``: a data server and two node daemons on this machine, the example job on
2 nodes x 2 workers (CPU, gloo), a worker killed, then a whole node lost — and for each failure
the timeline (failure → detected → restarted → restored → data ready → first step), the steps
lost, and a bitwise check of the final weights against a failure-free run.

Workers are started the way torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR/PORT; every rank
restarted when one fails), by this module: torchrun's own restarts are not reliable on one
machine yet (docs/decisions.md). Writes ``timeline.png``, ``loss.png`` and ``demo.json`` to
``--out``; removes every process and shared-memory folder it made.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer_client.local_cluster import LocalCluster

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_ffplane.py"
STAGES = ("detected", "restarted", "restored", "data_ready", "first_step")


@dataclass
class _Run:
    """One launch of every rank; ``placement[rank]`` is the node (daemon index) it runs on."""

    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    placement: list[int] = field(default_factory=list)

    def kill(self, ranks: list[int] | None = None) -> None:
        for rank, p in enumerate(self.procs):
            if (ranks is None or rank in ranks) and p.poll() is None:
                p.kill()
        for rank, p in enumerate(self.procs):
            if ranks is None or rank in ranks:
                p.wait()


class Demo:
    def __init__(self, work: Path, out: Path, steps: int) -> None:
        self.work, self.out, self.steps = work, out, steps
        self.token = secrets.token_hex(16)
        self.events = work / "events"
        self.events.mkdir(parents=True)
        self.cluster = LocalCluster(work, work / "datasets", self.token)
        self.runs: list[_Run] = []

    # --- set-up --------------------------------------------------------------------------
    def prepare(self) -> None:
        import numpy as np
        import pyarrow as pa
        import pyarrow.parquet as pq

        from dataserver.ingest import IngestConfig, ingest

        rng = np.random.default_rng(0)
        rows = rng.integers(0, 512, size=(4096, 33), dtype=np.int64)
        pq.write_table(pa.table({"tokens": pa.array(list(rows))}), self.work / "tokens.parquet")
        (self.work / "datasets").mkdir()
        ingest(IngestConfig([self.work / "tokens.parquet"], self.work / "datasets" / "tokens", progress=False))
        self.cluster.start_dataserver()
        for _ in range(2):
            self.cluster.start_daemon(budget_mb=512)
        for job in ("reference", "demo"):
            self._post("/v1/jobs", {"name": job, "dataset": "tokens", "dp": 4, "batch_per_rank": 8, "seed": 0, "max_steps": self.steps})

    def _post(self, path: str, body: dict[str, Any]) -> None:
        import urllib.request

        assert self.cluster.dataserver is not None
        req = urllib.request.Request(self.cluster.dataserver.url + path, json.dumps(body).encode(), method="POST")
        req.add_header("Authorization", f"Bearer {self.token}")
        req.add_header("Content-Type", "application/json")
        urllib.request.urlopen(req, timeout=10).read()

    def _status(self) -> dict[str, Any]:
        import urllib.request

        assert self.cluster.dataserver is not None
        result: dict[str, Any] = json.loads(urllib.request.urlopen(self.cluster.dataserver.url + "/v1/jobs/demo/status", timeout=10).read())
        return result

    # --- workers -------------------------------------------------------------------------
    def launch(self, job: str, placement: list[int], log_name: str) -> _Run:
        assert self.cluster.dataserver is not None
        run = _Run(placement=placement)
        (self.work / job).mkdir(exist_ok=True)
        port = random.randrange(20000, 60000)
        for rank, node in enumerate(placement):
            env = {
                **os.environ, "RANK": str(rank), "WORLD_SIZE": str(len(placement)), "LOCAL_RANK": str(rank % 2),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "FFPLANE_NODE": f"n{node}",
                "FFPLANE_DATASERVER": self.cluster.dataserver.url, "FFPLANE_TOKEN": self.token,
                "FFPLANE_DAEMON_SOCKET": str(self.cluster.socket(node)), "FFPLANE_EVENTS_DIR": str(self.events),
            }
            argv = [sys.executable, str(EXAMPLE), "--job", job, "--out", str(self.work / job), "--steps", str(self.steps)]
            with open(self.work / f"{log_name}-rank{rank}.log", "ab") as log:
                run.procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
        self.runs.append(run)
        return run

    def saved_steps(self, since: float) -> dict[int, int]:
        """rank → newest step it saved after ``since``."""
        newest: dict[int, int] = {}
        for e in self._events():
            if e["kind"] == "saved" and e["t"] >= since:
                newest[e["rank"]] = max(newest.get(e["rank"], -1), e["step"])
        return newest

    def _events(self) -> list[dict[str, Any]]:
        out = []
        for f in self.events.glob("events-*.jsonl"):
            for line in f.read_text().splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue  # a line being written
        return sorted(out, key=lambda e: e["t"])

    def wait_step(self, run: _Run, step: int, since: float, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while min(self.saved_steps(since).values(), default=-1) < step or len(self.saved_steps(since)) < len(run.procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in run.procs):
                raise RuntimeError(f"the job did not reach step {step}; logs in {self.work}")
            time.sleep(0.05)

    def wait_done(self, run: _Run, timeout_s: float = 180) -> None:
        for p in run.procs:
            if p.wait(timeout=timeout_s) != 0:
                raise RuntimeError(f"a worker failed; logs in {self.work}")

    # --- failures ------------------------------------------------------------------------
    def timeline(self, kind: str, failed_at: float, detected_at: float, saved_before: int) -> dict[str, Any]:
        """Seconds from the failure to each stage (the slowest rank), and the steps lost."""
        ev = [e for e in self._events() if e["t"] >= failed_at]
        starts = [e["t"] for e in ev if e["kind"] == "process_start"]
        restored = [e for e in ev if e["kind"] == "restored"]
        ready = [e["t"] for e in ev if e["kind"] == "data_ready"]
        if not restored:
            raise RuntimeError("no rank restored after the failure")
        step = restored[0]["step"]
        first: dict[int, float] = {}
        for e in ev:
            if e["kind"] == "saved" and e["step"] == step + 1:
                first.setdefault(e["rank"], e["t"])
        stamps = {
            "detected": detected_at, "restarted": max(starts), "restored": max(e["t"] for e in restored),
            "data_ready": max(ready), "first_step": max(first.values()),
        }
        return {
            "failure": kind, "restored_step": step, "steps_lost": saved_before - step,
            "seconds": {k: round(v - failed_at, 3) for k, v in stamps.items()},
        }

    def run(self) -> dict[str, Any]:
        t0 = time.time()
        print("[1/4] failure-free reference run (2 nodes x 2 workers)", flush=True)
        self.wait_done(self.launch("reference", [0, 0, 1, 1], "reference"))

        print("[2/4] the same job; a worker will be SIGKILLed", flush=True)
        since = time.time()
        run = self.launch("demo", [0, 0, 1, 1], "demo")
        self.wait_step(run, self.steps // 4, since)
        saved_before = max(self.saved_steps(since).values())
        victim = run.procs[1].pid
        failed_at = time.time()
        run.kill([1])
        detected_at = self._until(lambda: any(w.get("pid") == victim for w in self._status().get("worker_exits", [])))
        run.kill()  # the launcher restarts every rank when one fails, as torchrun does
        run = self.launch("demo", [0, 0, 1, 1], "demo")
        self.wait_step(run, self.steps // 4 + 2, failed_at)
        worker = self.timeline("worker SIGKILL", failed_at, detected_at, saved_before)

        print("[3/4] node n1 lost (its daemon, workers and shared memory); a replacement joins", flush=True)
        self.wait_step(run, self.steps // 2, failed_at)
        saved_before = max(self.saved_steps(failed_at).values())
        failed_at = time.time()
        run.kill([2, 3])
        self.cluster.lose_node(1)
        detected_at = self._until(lambda: "n1" in self._status().get("dead", []))
        run.kill()
        self.cluster.start_daemon(index=2, budget_mb=512)
        self._until(lambda: "n2" in self._status().get("ring", []))
        run = self.launch("demo", [2, 2, 0, 0], "demo")  # ranks 0-1 move to the new node, 2-3 to n0
        self.wait_done(run)
        node = self.timeline("node loss", failed_at, detected_at, saved_before)

        print("[4/4] checking the final weights against the reference", flush=True)
        import torch

        a, b = torch.load(self.work / "demo" / "final.pt"), torch.load(self.work / "reference" / "final.pt")
        bitwise = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        result = {"timelines": [worker, node], "bitwise_equal": bitwise, "steps": self.steps, "seconds": round(time.time() - t0, 1)}
        self._report(result)
        return result

    def _until(self, fn: Any, timeout_s: float = 60) -> float:
        deadline = time.monotonic() + timeout_s
        while not fn():
            if time.monotonic() > deadline:
                raise RuntimeError("the coordinator did not notice the failure")
            time.sleep(0.02)
        return time.time()

    # --- report --------------------------------------------------------------------------
    def _losses(self) -> dict[int, float]:
        losses: dict[int, float] = {}
        for f in sorted(self.work.glob("demo-rank0.log")):
            for line in f.read_text().splitlines():
                if line.startswith("step "):
                    _, step, _, loss = line.split()
                    losses[int(step)] = float(loss)
        return losses

    def _report(self, result: dict[str, Any]) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        print(f"\n{'failure':16s}" + "".join(f"{s:>12s}" for s in STAGES) + "   steps lost")
        for t in result["timelines"]:
            print(f"{t['failure']:16s}" + "".join(f"{t['seconds'][s]:11.2f}s" for s in STAGES) + f"   {t['steps_lost']}")
        print(f"\nfinal weights bitwise-equal to the failure-free run: {result['bitwise_equal']}   ({result['seconds']} s in all)")
        (self.out / "demo.json").write_text(json.dumps({**result, "losses": self._losses()}, indent=1))
        try:
            self._plots(result)
        except ImportError:
            print("(matplotlib is not installed: no PNGs)")
        print(f"wrote {self.out / 'demo.json'}, {self.out / 'timeline.png'}, {self.out / 'loss.png'}")

    def _plots(self, result: dict[str, Any]) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 2.6))
        colors = ["#c44e52", "#dd8452", "#4c72b0", "#55a868", "#8172b3"]
        for i, t in enumerate(result["timelines"]):
            prev = 0.0
            for stage, color in zip(STAGES, colors):
                end = t["seconds"][stage]
                ax.barh(i, end - prev, left=prev, color=color, label=stage if i == 0 else None)
                prev = end
        ax.set_yticks(range(len(result["timelines"])), [t["failure"] for t in result["timelines"]])
        ax.set_xlabel("seconds after the failure")
        ax.legend(ncol=5, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 1.35))
        fig.tight_layout()
        fig.savefig(self.out / "timeline.png", dpi=110)
        plt.close(fig)
        losses = self._losses()
        fig, ax = plt.subplots(figsize=(9, 3.2))
        ax.plot(sorted(losses), [losses[s] for s in sorted(losses)], color="#4c72b0")
        for t in result["timelines"]:
            ax.axvline(t["restored_step"] + t["steps_lost"] + 0.5, color="#c44e52", linestyle="--")
            ax.annotate(t["failure"], (t["restored_step"] + t["steps_lost"] + 0.7, max(losses.values())), fontsize=8, color="#c44e52")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (rank 0)")
        fig.tight_layout()
        fig.savefig(self.out / "loss.png", dpi=110)
        plt.close(fig)

    def close(self) -> None:
        for run in self.runs:
            run.kill()
        self.cluster.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ffplane", description="ffplane on this machine")
    sub = ap.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="two nodes, a killed worker, a lost node: timelines and a bitwise check")
    demo.add_argument("--out", type=Path, default=Path("ffplane-demo"), help="where demo.json and the PNGs go")
    demo.add_argument("--steps", type=int, default=40)
    demo.add_argument("--keep", action="store_true", help="keep the work folder (logs, events)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ffplane-demo-"))
    d = Demo(work, args.out, args.steps)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        d.prepare()
        result = d.run()
    finally:
        d.close()
        signal.signal(signal.SIGINT, old)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"work folder kept: {work}")
    return 0 if result["bitwise_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
