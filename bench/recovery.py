"""Recovery against today's practice: the example GPT job on 2 nodes x 2 workers, one torchrun per
node, on ffplane and as most jobs run today — torch.save to disk every K steps (K = 10 and 50),
the same model, data and launcher — each side measured in the same run.

    python bench/recovery.py                  # ~20 min here
    python bench/recovery.py --repeats 1 --goodput-failures 1 --goodput-interval 15   # a smoke

For a worker SIGKILL and for a node loss (torchrun, workers and, on ffplane, the node's daemon
and shared memory gone; a replacement node joins), the MTTR breakdown — detected (torchrun logs
the failed worker), restarted (the last new worker process started), restored, data ready,
first step done (every rank), caught up (every rank past the step it had reached when the
failure hit: the lost steps redone) — and the steps lost (newest step done before the failure
minus the step training resumed from). Then goodput: useful steps per minute over a run with a worker
SIGKILLed every ``--goodput-interval`` seconds, over the same system's failure-free run.

Writes bench/results/recovery.json and recovery.png.

    python bench/recovery.py --spare          # ~6 min: the README's --rdzv-backend ffplane line

``--spare``: the job launched with ``--rdzv-backend ffplane`` (etcd, 3 members on loopback; dead
nodes from the coordinator) and a warm spare node; a node loss, then the loss of the node whose
agent is rank 0 (under c10d, the node hosting the rendezvous), a new spare after each — beside,
in the same run, today's c10d node loss (replacement started after the failure) and what c10d
does when its rendezvous host is lost. Writes bench/results/recovery_spare.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, write_results  # noqa: E402
from ffplane_harness.job_runner import EXAMPLE, STAGES, STARTUP, LocalJobs  # noqa: E402
from ffplane_harness.torchrun import TorchrunNode  # noqa: E402

PLAIN = Path(__file__).resolve().parent / "_plain_job.py"
_AGENT_FAILED = re.compile(r"^[EW](\d{4}) (\d\d:\d\d:\d\d\.\d+) .*failed \(exitcode")


class System(LocalJobs):
    """One side of the comparison: ``save_every`` None for ffplane, else torch.save every K."""

    def __init__(self, work: Path, steps: int, save_every: int | None) -> None:
        super().__init__(work, steps, script=EXAMPLE if save_every is None else PLAIN)
        self.save_every = save_every
        self.warm = save_every is None  # today's practice starts every restarted worker cold
        self.max_restarts = 1000
        self.name = "ffplane" if save_every is None else f"torch.save K={save_every}"
        self.runs = 0
        self.placement = [0, 1]
        self.next_daemon = 2

    def new_job(self) -> str:
        """A fresh job name (and, for torch.save, a fresh checkpoint directory)."""
        self.runs += 1
        job = f"run{self.runs}"
        if self.save_every is None:
            self.post("/v1/jobs", {"name": job, "dataset": "tokens", "dp": 4, "batch_per_rank": 8, "seed": 0, "max_steps": self.steps})
        else:
            self.script_args = ["--data", str(self.work / "tokens.parquet"), "--save-every", str(self.save_every)]
        return job

    def wait_steps(self, job: str, nodes: list[TorchrunNode], beyond: int, since: float, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            s = self.saved_steps(since, job)
            if len(s) == self.world(nodes) and min(s.values()) > beyond:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: {job} did not get past step {beyond}; logs in {self.work}")
            time.sleep(0.05)

    # --- failures ------------------------------------------------------------------------
    def victim(self, job: str, since: float | None = None) -> int:
        """A worker of ``job`` on the first node that has saved since ``since`` (default: the
        last 30 s), to SIGKILL."""
        return self.worker_pid(f"n{self.placement[0]}", time.time() - 30 if since is None else since, job)

    def lose_node(self, job: str, nodes: list[TorchrunNode]) -> None:
        """Node 1 is gone; a replacement node joins (on ffplane: an empty daemon, registered)."""
        nodes[1].kill()
        if self.save_every is None:
            self.cluster.lose_node(self.placement[1])
            new = self.next_daemon
            self.next_daemon += 1
            self.start_daemon(new)
            self.until(lambda: f"n{new}" in self.status(job).get("ring", []))
            self.placement[1] = new
        nodes[1] = self.launch(job, self.placement[1], nodes[0].endpoint, job)

    def detected(self, job: str, after: float) -> float | None:
        """When a torchrun agent first logged a failed worker after ``after`` (its own clock)."""
        year = datetime.datetime.now().year
        first = None
        for log in self.work.glob(f"{job}-n*.log"):
            for line in log.read_text(errors="replace").splitlines():
                m = _AGENT_FAILED.match(line)
                if m:
                    t = datetime.datetime.strptime(f"{year}{m.group(1)} {m.group(2)}", "%Y%m%d %H:%M:%S.%f").astimezone().timestamp()
                    if t >= after and (first is None or t < first):
                        first = t
        return first

    # --- runs ----------------------------------------------------------------------------
    def mttr(self, repeats: int) -> list[dict[str, Any]]:
        """One job; a worker kill, then a node loss, ``repeats`` times, a few steps apart."""
        job = self.new_job()
        since = time.time()
        nodes = self.launch_job(job, self.placement)
        out = []
        for _ in range(repeats):
            for kind in ("worker SIGKILL", "node loss"):
                newest = max(self.saved_steps(since, job).values(), default=-1)
                # a few steps past the last restore, off any checkpoint boundary for torch.save
                self.wait_steps(job, nodes, newest + 6, since)
                # the victim is chosen before the clock starts: reading the event files takes long
                # enough for a step to finish in between
                victim = self.victim(job) if kind == "worker SIGKILL" else 0
                failed_at = time.time()
                if kind == "worker SIGKILL":
                    os.kill(victim, signal.SIGKILL)
                else:
                    self.lose_node(job, nodes)
                # the newest step done when the failure hit (read after it: a line stamped before
                # ``failed_at`` may land in its file a moment later)
                saved_before = max(self.saved_steps(since, job, until=failed_at).values())
                self.wait_steps(job, nodes, saved_before + 1, failed_at)  # caught up
                out.append(self.timeline(kind, failed_at, self.detected(job, failed_at) or failed_at, saved_before, job))
                print(
                    f"  {self.name:18s} {kind:15s} first step after {out[-1]['seconds']['first_step']:6.2f} s, lost {out[-1]['steps_lost']}, caught up after {out[-1]['seconds']['caught_up']:6.2f} s",
                    flush=True,
                )
        self.finish(nodes)
        return out

    def finish(self, nodes: list[TorchrunNode]) -> None:
        for n in nodes:
            n.kill()

    def goodput(self, failures: int, interval_s: float) -> dict[str, Any]:
        """Steps per minute with a worker SIGKILLed every ``interval_s`` seconds (from the first
        step), and without failures; the same number of steps."""

        def run(fail: bool) -> float:
            job = self.new_job()
            started = time.time()
            nodes = self.launch_job(job, self.placement)
            self.wait_steps(job, nodes, -1, started)
            first = last_kill = time.time()
            kills = 0
            while any(n.running() for n in nodes):
                if fail and kills < failures and time.time() - first >= (kills + 1) * interval_s:
                    # a worker that saved since the last kill: not the last victim (dead, or a
                    # zombie a kill would count) before its replacement has saved; else look again
                    with contextlib.suppress(StopIteration, ProcessLookupError):
                        os.kill(self.victim(job, since=last_kill), signal.SIGKILL)
                        last_kill = time.time()
                        kills += 1
                time.sleep(0.05)
            self.wait_done(nodes)
            last = max(e["t"] for e in self.events(job) if e["kind"] == "saved")
            return self.steps / ((last - first) / 60)

        free = run(False)
        failing = run(True)
        return {
            "steps_per_min_failure_free": round(free, 1),
            "steps_per_min_with_failures": round(failing, 1),
            "goodput": round(failing / free, 3),
        }


class SpareSystem(System):
    """ffplane launched with ``--rdzv-backend ffplane`` (etcd, the coordinator's dead nodes) and a
    warm spare node waiting (daemon running, zygote started, agent in torch's redundancy list)."""

    def __init__(self, work: Path, steps: int) -> None:
        super().__init__(work, steps, None)
        self.name = "ffplane + spare (etcd rdzv)"

    def world(self, nodes: list[TorchrunNode]) -> int:
        return 2 * self.nproc  # the job's two nodes, however many spares wait beside them

    def active(self, job: str, nodes: list[TorchrunNode], since: float) -> list[TorchrunNode]:
        """The running nodes whose workers saved since ``since`` (not the waiting spare)."""
        names = {e["node"] for e in self.events(job) if e["kind"] == "saved" and e["t"] >= since}
        return [n for n in nodes if n.running() and n.env["FFPLANE_NODE"] in names]

    def spare_mttr(self, repeats: int) -> list[dict[str, Any]]:
        """One job on 2 nodes + a spare; a worker SIGKILL, a node loss (not rank 0's), then the
        rank-0 node's loss (under c10d, the rendezvous host), ``repeats`` times; a new spare
        after each node loss."""
        job = self.new_job()
        since = time.time()
        nodes = self.launch_job(job, [0, 1])
        self.wait_steps(job, nodes, 1, since)
        self.until_warm(nodes)  # restarts are warm from here on
        nodes.append(self.launch_spare(job, 2, nodes))
        self.next_daemon = 3
        out = []
        for _ in range(repeats):
            for kind in ("worker SIGKILL", "node loss (spare)", "rank-0 node loss (spare)"):
                recent = time.time()
                self.wait_steps(job, self.active(job, nodes, since), max(self.saved_steps(since, job).values()) + 6, since)
                active = self.active(job, nodes, recent)
                host = next(e["node"] for e in reversed(self.events(job)) if e["kind"] == "saved" and e["rank"] == 0)
                victim = next(n for n in active if (n.env["FFPLANE_NODE"] == host) == kind.startswith("rank-0"))
                pid = self.worker_pid(victim.env["FFPLANE_NODE"], recent, job)
                failed_at = time.time()
                if kind == "worker SIGKILL":
                    os.kill(pid, signal.SIGKILL)
                else:
                    victim.kill()
                    self.cluster.lose_node(int(victim.env["FFPLANE_NODE"][1:]))
                saved_before = max(self.saved_steps(since, job, until=failed_at).values())
                self.wait_steps(job, [n for n in nodes if n.running()], saved_before + 1, failed_at)
                out.append(self.timeline(kind, failed_at, self.detected(job, failed_at) or failed_at, saved_before, job))
                print(
                    f"  {self.name:26s} {kind:24s} first step after {out[-1]['seconds']['first_step']:6.2f} s, lost {out[-1]['steps_lost']}",
                    flush=True,
                )
                if kind == "worker SIGKILL":
                    continue
                new = self.next_daemon  # the next spare: a fresh node
                self.next_daemon += 1
                self.start_daemon(new)
                self.until(lambda: f"n{new}" in self.status(job).get("ring", []))
                nodes.append(self.launch_spare(job, new, nodes))
        self.finish(nodes)
        return out


def c10d_host_loss(work: Path) -> dict[str, Any]:
    """Today's launcher line (c10d): the node hosting the rendezvous endpoint is lost; what the
    survivor's torchrun does."""
    system = System(work, steps=400, save_every=None)
    try:
        system.prepare([], rows=8192)
        job = system.new_job()
        since = time.time()
        nodes = system.launch_job(job, [0, 1])
        system.wait_steps(job, nodes, 4, since)
        failed_at = time.time()
        nodes[0].kill()  # the is_host agent's node
        system.cluster.lose_node(0)
        try:
            rc: int | None = nodes[1].wait(60)
        except subprocess.TimeoutExpired:  # still running after 60 s: it survived after all
            rc = None
        log = (work / f"{job}-n1.log").read_text(errors="replace")
        error = next((line.strip() for line in reversed(log.splitlines()) if "Error" in line), "")
        return {"survived": rc is None, "survivor_exit": rc, "seconds_to_exit": round(time.time() - failed_at, 2), "error": error[:300]}
    finally:
        system.close()


def spare_rows(repeats: int, keep: bool = False) -> dict[str, Any]:
    """The node-loss-with-spare and rank-0-node-loss rows, beside today's node loss (c10d, a
    replacement started after the failure) and c10d's rendezvous-host loss, in the same run."""
    out: dict[str, Any] = {}
    for cls in (SpareSystem, System):
        work = Path(tempfile.mkdtemp(prefix="ffplane-recovery-"))
        # room for every failure: a few steps before each, and the steps run while a new spare starts
        # (a spare is ready once its zygote has torch imported: ~3 s of steps each)
        steps = 80 + repeats * 3 * 60 if cls is SpareSystem else 60 + repeats * 2 * 10
        system = SpareSystem(work, steps) if cls is SpareSystem else System(work, steps, None)
        print(f"[{system.name}]", flush=True)
        try:
            if isinstance(system, SpareSystem):
                system.prepare([], daemons=3, rows=8192, rendezvous="ffplane")
                timelines = system.spare_mttr(repeats)
            else:
                system.prepare([], rows=8192)
                timelines = system.mttr(repeats)
        finally:
            system.close()
            if keep:
                print(f"  work folder kept: {work}", flush=True)
            else:
                shutil.rmtree(work, ignore_errors=True)
        out[system.name] = by_kind(timelines)
    work = Path(tempfile.mkdtemp(prefix="ffplane-recovery-"))
    try:
        out["c10d rendezvous-host loss"] = c10d_host_loss(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def by_kind(timelines: list[dict[str, Any]]) -> dict[str, Any]:
    """Each failure kind's figures over its timelines."""
    out: dict[str, Any] = {}
    for kind in dict.fromkeys(t["failure"] for t in timelines):
        ts = [t for t in timelines if t["failure"] == kind]
        out[kind] = {
            "mttr_s": _summary([t["seconds"]["first_step"] for t in ts]),
            "caught_up_s": _summary([t["seconds"]["caught_up"] for t in ts]),
            "stages_median_s": {s: statistics.median(t["seconds"][s] for t in ts) for s in (*STAGES, "caught_up")},
            # the start-up inside "restarted → restored": torch loaded, process group + model + DDP
            "startup_median_s": {s: statistics.median(t["seconds"][s] for t in ts) for s in STARTUP if all(s in t["seconds"] for t in ts)},
            "steps_lost": _summary([t["steps_lost"] for t in ts]),
            "timelines": ts,
        }
    return out


def _summary(samples: list[float]) -> dict[str, Any]:
    return {"min": min(samples), "median": statistics.median(samples), "max": max(samples), "samples": samples}


def measure(system: System, repeats: int, failures: int, interval_s: float, steps_per_s: float | None) -> tuple[dict[str, Any], float]:
    timelines = system.mttr(repeats)
    figures: dict[str, Any] = by_kind(timelines)
    if steps_per_s is None:  # size the goodput runs from this system's pace: ``failures`` intervals
        ev = [e for e in system.events("run1") if e["kind"] == "saved" and e["rank"] == 0]
        steps_per_s = (ev[-1]["step"] - ev[0]["step"]) / max(ev[-1]["t"] - ev[0]["t"], 1e-3) if len(ev) > 1 else 5.0
    system.steps = max(60, int(steps_per_s * interval_s * (failures + 0.5)))
    figures["goodput"] = {**system.goodput(failures, interval_s), "steps": system.steps}
    return figures, steps_per_s


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="worker kills and node losses per system")
    ap.add_argument("--goodput-failures", type=int, default=2)
    ap.add_argument("--goodput-interval", type=float, default=45.0, help="seconds between worker kills in the goodput run")
    ap.add_argument("--k", default="10,50", help="torch.save every K steps, for each K")
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    ap.add_argument("--keep", action="store_true", help="keep each system's work folder (logs, events) under /tmp")
    ap.add_argument("--out", default=None, help="results name (default recovery, or recovery_spare with --spare)")
    ap.add_argument(
        "--spare",
        action="store_true",
        help="only the rows of the README's --rdzv-backend ffplane line with a warm spare: node loss, rank-0 node loss; "
        "beside c10d's node loss and rendezvous-host loss",
    )
    args = ap.parse_args(argv)
    if args.spare:
        return _spare_main(args)
    args.out = args.out or "recovery"
    sides: list[int | None] = [None, *(int(k) for k in args.k.split(",") if k)]
    results: dict[str, Any] = {}
    pace = None
    for save_every in sides:
        work = Path(tempfile.mkdtemp(prefix="ffplane-recovery-"))
        # long enough for the MTTR run: repeats x 2 failures, each after 6 steps plus what a
        # torch.save restart rewinds
        system = System(work, steps=60 + args.repeats * 2 * (8 + 2 * (save_every or 1)), save_every=save_every)
        print(f"[{system.name}]", flush=True)
        try:
            system.prepare([], rows=8192)
            results[system.name], pace = measure(system, args.repeats, args.goodput_failures, args.goodput_interval, pace)
        finally:
            system.close()
            shutil.rmtree(work, ignore_errors=True)
    ours = results["ffplane"]
    checks: dict[str, Any] = {
        "worker_kill_mttr_s<=5": ours["worker SIGKILL"]["mttr_s"]["median"] <= 5,
        "node_loss_mttr_s<=10": ours["node loss"]["mttr_s"]["median"] <= 10,
        "lost_steps<=1": max(ours["worker SIGKILL"]["steps_lost"]["max"], ours["node loss"]["steps_lost"]["max"]) <= 1,
        "goodput>=0.95": ours["goodput"]["goodput"] >= 0.95,
    }
    config = {
        "nodes": 2,
        "workers_per_node": 2,
        "repeats": args.repeats,
        "goodput_failures": args.goodput_failures,
        "goodput_interval_s": args.goodput_interval,
        "k": args.k,
        "launcher": "torchrun (c10d, one per node)",
    }
    path = write_results(args.out, results, config, checks, args.results_dir)
    _print(results)
    _plot(results, args.results_dir / f"{args.out}.png")
    print(f"targets: {checks}\nwrote {path}")
    return {"figures": results, "targets": checks}


def _spare_main(args: argparse.Namespace) -> dict[str, Any]:
    results = spare_rows(args.repeats, args.keep)
    spare, today = results["ffplane + spare (etcd rdzv)"], results["ffplane"]
    base = today["node loss"]["mttr_s"]["median"]
    print(f"\n{'launcher':28s} {'failure':26s} {'first step (median)':>20s}  lost  vs c10d node loss")
    for name, kinds in (("ffplane + spare (etcd rdzv)", spare), ("ffplane (c10d)", today)):
        for kind, fig in kinds.items():
            m = fig["mttr_s"]["median"]
            print(f"{name:28s} {kind:26s} {m:19.2f}s  {fig['steps_lost']['median']:4.0f}  {m / base:5.2f}x")
    host = results["c10d rendezvous-host loss"]
    print(
        f"c10d rendezvous-host loss: survived {host['survived']} (survivor's torchrun exit {host['survivor_exit']}: {host['error'][:120]})"
    )
    checks = {
        "worker_kill_mttr_s<=2": spare["worker SIGKILL"]["mttr_s"]["median"] <= 2,
        "node_loss_with_spare_mttr_s<=5": spare["node loss (spare)"]["mttr_s"]["median"] <= 5,
        "rank0_node_loss_survived": all(t["restored_step"] >= 0 for t in spare["rank-0 node loss (spare)"]["timelines"]),
        "steps_lost_median_0": max(f["steps_lost"]["median"] for f in spare.values()) == 0,
        "steps_lost_max<=1": max(f["steps_lost"]["max"] for f in spare.values()) <= 1,
    }
    config = {
        "nodes": 2,
        "spares": 1,
        "workers_per_node": 2,
        "repeats": args.repeats,
        "launcher": "torchrun --rdzv-backend ffplane (3 etcd members on loopback) vs --rdzv-backend c10d; "
        "keep_alive_interval=1 with max_attempt 3 (ffplane) / 2 (c10d); the harness adds --local-addr 127.0.0.1 "
        "(every node on this machine) and --monitor-interval 0.2",
    }
    path = write_results(args.out or "recovery_spare", results, config, checks, args.results_dir)
    print(f"targets: {checks}\nwrote {path}")
    return {"figures": results, "targets": checks}


def _print(results: dict[str, Any]) -> None:
    base = results["ffplane"]
    print(
        f"\n{'system':18s} {'failure':15s}" + "".join(f"{s:>11s}" for s in (*STAGES, "caught_up")) + "  lost  MTTR / caught up vs ffplane"
    )
    for name, fig in results.items():
        for kind in ("worker SIGKILL", "node loss"):
            st = fig[kind]["stages_median_s"]
            ratio = fig[kind]["mttr_s"]["median"] / base[kind]["mttr_s"]["median"]
            back = fig[kind]["caught_up_s"]["median"] / base[kind]["caught_up_s"]["median"]
            print(
                f"{name:18s} {kind:15s}"
                + "".join(f"{st[s]:10.2f}s" for s in (*STAGES, "caught_up"))
                + f"  {fig[kind]['steps_lost']['median']:4.0f}  {ratio:5.2f}x / {back:5.2f}x"
            )
    print("\nworker start-up inside restarted → restored (median s after the failure):")
    for name, fig in results.items():
        for kind in ("worker SIGKILL", "node loss"):
            st = fig[kind]
            print(
                f"{name:18s} {kind:15s} restarted {st['stages_median_s']['restarted']:.2f}"
                + "".join(f", {s} {v:.2f}" for s, v in st.get("startup_median_s", {}).items())
                + f", restored {st['stages_median_s']['restored']:.2f}"
            )
    print(f"\n{'system':18s} goodput (steps/min with failures / failure-free)   vs ffplane")
    for name, fig in results.items():
        g = fig["goodput"]
        print(
            f"{name:18s} {g['goodput']:.3f} ({g['steps_per_min_with_failures']} / {g['steps_per_min_failure_free']})   {g['goodput'] / base['goodput']['goodput']:.2f}x"
        )


def _plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    colors = ["#c44e52", "#dd8452", "#4c72b0", "#55a868", "#8172b3"]
    rows = [(f"{name}\n{kind}", fig[kind]["stages_median_s"]) for name, fig in results.items() for kind in ("worker SIGKILL", "node loss")]
    fig, ax = plt.subplots(figsize=(9, 0.5 + 0.45 * len(rows)))
    for i, (_, st) in enumerate(rows):
        prev = 0.0
        for stage, color in zip(STAGES, colors):
            ax.barh(i, st[stage] - prev, left=prev, color=color, label=stage if i == 0 else None)
            prev = max(prev, st[stage])
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds after the failure (median)")
    ax.legend(ncol=5, fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
