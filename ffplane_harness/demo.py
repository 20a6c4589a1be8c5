"""``ffplane demo``: a data server and two node daemons on this machine, the example job on
2 nodes x 2 workers (CPU, gloo), a worker killed, then a whole node lost — and for each failure
the timeline (failure → detected → restarted → restored → data ready → first step), the steps
lost, and a bitwise check of the final weights against a failure-free run.

Each node is one ``torchrun`` (c10d rendezvous, ``--max-restarts``), as users launch jobs: torchrun
restarts the workers of a node whose worker died and, through the rendezvous, every other node's;
a lost node's agent dies with it and a replacement agent joins the next round. Writes
``timeline.png``, ``loss.png`` and ``demo.json`` to ``--out`` (by default a new folder in the temp
dir, not the working tree, named when the demo starts); removes every process and shared-memory
folder it made.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from ffplane_harness.job_runner import MODELS, STAGES, LocalJobs


class Demo(LocalJobs):
    def __init__(self, work: Path, out: Path, steps: int, model: str = "gpt") -> None:
        script, self.model_args = MODELS[model]
        super().__init__(work, steps, script=script)
        self.script_args = list(self.model_args)
        self.out, self.model = out, model

    def run(self) -> dict[str, Any]:
        t0 = time.time()
        what = " ".join([self.script.name, *self.model_args])
        print(f"[1/4] failure-free reference run of {what} (2 nodes x 2 workers, one torchrun per node)", flush=True)
        self.wait_done(self.launch_job("reference", [0, 1]))

        print("[2/4] the same job; a worker will be SIGKILLed", flush=True)
        since = time.time()
        nodes = self.launch_job("demo", [0, 1])
        self.wait_step(nodes, self.steps // 4, since)
        victim = self.worker_pid("n0", since)
        failed_at = time.time()
        os.kill(victim, signal.SIGKILL)  # torchrun restarts n0's workers, and n1's through the rendezvous
        detected_at = self.until(lambda: any(w.get("pid") == victim for w in self.status("demo").get("worker_exits", [])))
        # the newest step saved when the failure hit, read after it: saves go on until the kill
        # (read before, a step saved in between counted as -1 lost), and a line stamped before
        # ``failed_at`` may land in its file a moment later
        saved_before = max(self.saved_steps(since, until=failed_at).values())
        self.wait_step(nodes, saved_before + 2, failed_at)
        worker = self.timeline("worker SIGKILL", failed_at, detected_at, saved_before)

        print("[3/4] node n1 lost (its torchrun, workers, daemon and shared memory); a replacement joins", flush=True)
        self.wait_step(nodes, self.steps // 2, failed_at)
        since = failed_at
        failed_at = time.time()
        nodes[1].kill()
        self.cluster.lose_node(1)
        detected_at = self.until(lambda: "n1" in self.status("demo").get("dead", []))
        saved_before = max(self.saved_steps(since, until=failed_at).values())
        self.cluster.start_daemon(index=2, budget_mb=512)
        self.until(lambda: "n2" in self.status("demo").get("ring", []))
        nodes[1] = self.launch("demo", 2, nodes[0].endpoint, "demo")  # ranks are re-assigned by the rendezvous
        self.wait_done(nodes)
        node = self.timeline("node loss", failed_at, detected_at, saved_before)

        print("[4/4] checking the final weights against the reference", flush=True)
        import torch

        a, b = torch.load(self.work / "demo" / "final.pt"), torch.load(self.work / "reference" / "final.pt")
        bitwise = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        result = {
            "model": self.model,
            "timelines": [worker, node],
            "bitwise_equal": bitwise,
            "steps": self.steps,
            "seconds": round(time.time() - t0, 1),
        }
        self._report(result)
        return result

    # --- report --------------------------------------------------------------------------
    def _losses(self) -> dict[int, float]:
        losses: dict[int, float] = {}
        for f in sorted(self.work.glob("demo-n*.log")):
            for line in f.read_text(errors="replace").splitlines():
                if line.startswith("step ") or ": step " in line:  # torchrun may prefix worker lines
                    _, step, _, loss = line.rsplit(" ", 4)[-4:]
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


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_demo(out: Path | None, steps: int, model: str, keep: bool) -> int:
    """``ffplane demo``: 0 when the run ends bitwise-equal to the failure-free one. Without
    ``out`` the results go to a new folder in the temp dir (a run in a checkout left an untracked
    ``ffplane-demo/`` in it)."""
    if out is None:
        out = Path(tempfile.mkdtemp(prefix="ffplane-demo-results-"))
    print(f"results go to {out}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="ffplane-demo-"))
    d = Demo(work, out, steps, model)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    old_term = signal.signal(signal.SIGTERM, _interrupted)  # a killed demo still ends its processes
    try:
        d.prepare(["reference", "demo"])
        result = d.run()
    finally:
        d.close()
        signal.signal(signal.SIGINT, old)
        signal.signal(signal.SIGTERM, old_term)
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"work folder kept: {work}")
    return 0 if result["bitwise_equal"] else 1
