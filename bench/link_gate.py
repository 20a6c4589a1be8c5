"""The idle-link gate: how much a TRAIN pattern slows down beside STATE traffic, gated and not.

    python bench/link_gate.py                    # 1 Gbit/s link, 20 bursts of 25 MiB, 100 ms gaps, 3 repeats (root)
    python bench/link_gate.py --bursts 4 --repeats 1     # smoke size

Three namespaces on a tbf-shaped bridge: the data server, node A and node B. TRAIN is a process on
A sending collective-sized bursts to B, each acknowledged (its completion), separated by compute
gaps, announcing every burst through ``trainer_client.LinkHints``. STATE is a role on A saving a
state every 0.3 s (one training step; more than the link can carry while TRAIN runs); A's daemon replicates every commit to B over the same link, through A's link
gate (hints, plus A's interface counters). Figures, each repeated: ``train_alone_s`` (no STATE),
``train_with_ungated_state_s`` (A's daemon started with ``--no-gate``) and
``train_with_gated_state_s``, plus the STATE bytes moved during each run and, for the gated run,
the share of the link's idle capacity (link rate x the time TRAIN left the link idle) they used.
Targets: gated ≤ 1.02 x alone, idle capacity used ≥ 0.7. Results: ``bench/results/link_gate.json``.
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, print_table, ratio, repeat, write_results  # noqa: E402
from bench.replication import _rate_gbps, _traffic  # noqa: E402
from ffplane_harness.local_cluster import LocalCluster  # noqa: E402
from ffplane_harness.netns import Netns  # noqa: E402

PORT = 5301


def _gate(url: str) -> dict[str, Any]:
    return httpx.get(url + "/v1/gate", timeout=10).json()


class _Sampler:
    """The gate's replication byte counter, sampled every 10 ms, read back at any instant."""

    def __init__(self) -> None:
        self.url = ""
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.wait(0.01):
                if self.url:
                    try:
                        n = client.get(self.url + "/v1/gate").json()["bytes_by_priority"]["replicate"]
                    except (httpx.HTTPError, KeyError):
                        continue
                    self.samples.append((time.time(), int(n)))

    def wait_past(self, when: float, timeout_s: float = 10.0) -> None:
        """Until a sample is taken after ``when``: a daemon busy pushing may answer a poll late,
        and a fixed wait was too short for it once on a loaded machine (the suite's smoke run)."""
        deadline = time.monotonic() + timeout_s
        while not (self.samples and self.samples[-1][0] >= when) and time.monotonic() < deadline:
            time.sleep(0.01)

    def at(self, when: float) -> float:
        before = [s for s in self.samples if s[0] <= when]
        after = [s for s in self.samples if s[0] >= when]
        if not before or not after:
            raise RuntimeError("no gate samples around the TRAIN run")
        (t0, b0), (t1, b1) = before[-1], after[0]
        return b0 if t1 == t0 else b0 + (b1 - b0) * (when - t0) / (t1 - t0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--bursts", type=int, default=20)
    ap.add_argument("--burst-mb", type=float, default=25, help="one collective: DDP's default bucket (bucket_cap_mb=25)")
    ap.add_argument("--gap-ms", type=float, default=100)
    ap.add_argument("--state-mb", type=float, default=64, help="the saving role's state")
    ap.add_argument("--chunk-kb", type=int, default=256, help="the gate's STATE chunk")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    ap.add_argument("--out", default="link_gate")
    args = ap.parse_args(argv)

    link = _rate_gbps(args.rate) * 1e9
    token = secrets.token_hex(16)
    work = Path(tempfile.mkdtemp(prefix="ffplane-bench-gate-"))
    (work / "data").mkdir()
    figures: dict[str, Any] = {}
    state_bytes: dict[str, list[float]] = {"alone": [], "ungated": [], "gated": []}
    idle_used: list[float] = []
    with Netns(3, rate=args.rate) as net, LocalCluster(work, work / "data", token, net=net) as c:
        c.start_dataserver()
        a, b = net.nodes[1], net.nodes[2]
        budget = str(int(args.state_mb * 8) + 128)
        procs = {"a": c.start_daemon(budget_mb=int(budget), index=0)}
        procs["b"] = c.start_daemon(budget_mb=int(budget), index=1)  # B, A's ring successor (n1)
        sink = _traffic(net, 2, "sink", str(PORT))
        assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
        saver: subprocess.Popen[str] | None = None

        def start_a(*extra: str) -> None:
            nonlocal saver
            if saver is not None:
                saver.kill()
                saver.wait()
            procs["a"].stop()
            # --replica-max-lag 0: this saver makes more STATE than the link can carry, so the
            # lag bound (a push passes the gate once its replica trails by two commits) would
            # always fire; the bench measures the gate itself
            gate = (
                "--gate-iface",
                a.iface,
                "--gate-link-mbit",
                str(link * 8 / 1e6),
                "--gate-chunk-kb",
                str(args.chunk_kb),
                "--replica-max-lag",
                "0",
            )
            procs["a"] = c.start_daemon(*gate, *extra, budget_mb=int(budget), index=0)
            c.until_successor(len(c.daemons) - 1, "n1")
            saver = _traffic(net, 1, "saver", str(c.socket(0)), "bench", str(args.state_mb))
            assert saver.stdout is not None and saver.stdout.readline().strip() == "ready"
            time.sleep(1.0)  # replication under way

        def run_train(case: str, with_state: bool) -> float:
            if saver is not None and not with_state:
                saver.send_signal(19)  # SIGSTOP: no new saves; let the last push drain
                time.sleep(1.5)
            sampler.url, sampler.samples = procs["a"].url, []
            proc = _traffic(net, 1, "train", b.addr, str(PORT), str(args.bursts), str(args.burst_mb), str(args.gap_ms), str(c.socket(0)))
            out, _ = proc.communicate(timeout=600)
            result = json.loads(out)
            sampler.wait_past(result["end"])
            moved = sampler.at(result["end"]) - sampler.at(result["start"])
            if saver is not None and not with_state:
                saver.send_signal(18)  # SIGCONT
            state_bytes[case].append(moved)
            if case == "gated":
                idle_s = result["total_s"] - sum(result["burst_s"])
                idle_used.append(moved / (link * idle_s))
            return float(result["total_s"])

        sampler = _Sampler()
        start_a()
        figures["train_alone_s"] = repeat(lambda: run_train("alone", False), args.repeats)
        figures["train_with_gated_state_s"] = repeat(lambda: run_train("gated", True), args.repeats)
        gate_view = _gate(procs["a"].url)
        start_a("--no-gate")
        figures["train_with_ungated_state_s"] = repeat(lambda: run_train("ungated", True), args.repeats)
        if saver is not None:
            saver.kill()
            saver.wait()
        sink.kill()
        sink.wait()
        sampler.close()

    def summary(xs: list[float]) -> dict[str, Any]:
        s = sorted(xs)
        return {"min": s[0], "median": s[len(s) // 2], "max": s[-1], "samples": xs}

    for case, xs in state_bytes.items():
        figures[f"state_bytes_{case}"] = summary(xs)
    figures["gated_idle_capacity_used"] = summary(idle_used)
    checks = {
        "gated_vs_alone": {"ratio": ratio(figures["train_with_gated_state_s"], figures["train_alone_s"]), "target": "<= 1.02"},
        "ungated_vs_alone": {"ratio": ratio(figures["train_with_ungated_state_s"], figures["train_alone_s"]), "target": "(the problem)"},
        "gated_idle_capacity_used": {"ratio": figures["gated_idle_capacity_used"]["median"], "target": ">= 0.7"},
    }
    print_table(
        [
            ("train_alone_s (baseline)", figures["train_alone_s"], ""),
            ("train_with_ungated_state_s", figures["train_with_ungated_state_s"], f"{checks['ungated_vs_alone']['ratio']:.3f}x alone"),
            ("train_with_gated_state_s", figures["train_with_gated_state_s"], f"{checks['gated_vs_alone']['ratio']:.3f}x alone"),
        ],
        "s",
    )
    print(
        f"STATE MiB moved per run: ungated {figures['state_bytes_ungated']['median'] / 2**20:.0f}, gated {figures['state_bytes_gated']['median'] / 2**20:.0f}; "
        f"gated used {figures['gated_idle_capacity_used']['median']:.2f} of the idle link"
    )
    config = {
        "rate": args.rate,
        "bursts": args.bursts,
        "burst_mb": args.burst_mb,
        "gap_ms": args.gap_ms,
        "state_mb": args.state_mb,
        "chunk_kb": args.chunk_kb,
        "repeats": args.repeats,
        "gate_after_gated_runs": gate_view,
    }
    path = write_results(args.out, figures, config, checks, args.results_dir)
    print(f"wrote {path}")
    return {"figures": figures, "targets": checks}


if __name__ == "__main__":
    main()
