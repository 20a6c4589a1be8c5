"""Where a node daemon's CPU goes per save: the example GPT job (as ``bench/step_cost.py`` runs
it) with both node daemons under ``cProfile`` timed by thread CPU (``time.thread_time``), not wall
time: a send that wakes the peer is not charged for the peer's work.

    python bench/daemon_profile.py                # 10 s of steady saves, top 25 functions
    python bench/daemon_profile.py --seconds 5 --top 40

The daemons are started with a ``sitecustomize`` (in a temporary folder on ``PYTHONPATH``) that
profiles only ``statestore`` processes; the profile is reset once 200 steps are done and dumped
``--seconds`` later. Per daemon it prints the CPU and the Python calls per save pair (a commit of a
local worker and a replica received from the other node), and the functions with the most own
CPU. Profiling inflates Python-heavy code: compare runs of this script, not its totals with
``step_cost.py``'s. Writes ``bench/results/daemon_profile.json``.
"""

from __future__ import annotations

import argparse
import os
import pstats
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, write_results  # noqa: E402
from bench.step_cost import ABLATE  # noqa: E402
from ffplane_harness.job_runner import LocalJobs  # noqa: E402

_SITE = """
import os, sys
if os.environ.get("FFPLANE_PROFILE_DIR") and "statestore" in " ".join(getattr(sys, "orig_argv", [])):
    import cProfile, signal, time
    _p = [cProfile.Profile(time.thread_time)]
    def _dump(*_):
        _p[0].disable()
        _p[0].dump_stats(os.path.join(os.environ["FFPLANE_PROFILE_DIR"], f"{os.getpid()}.prof"))
    def _reset(*_):
        _p[0].disable()
        _p[0] = cProfile.Profile(time.thread_time)
        _p[0].enable()
    signal.signal(signal.SIGUSR1, _dump)
    signal.signal(signal.SIGUSR2, _reset)
    _p[0].enable()
"""


def _saves(jobs: LocalJobs, job: str) -> int:
    return sum(1 for e in jobs.events(job) if e["kind"] == "saved")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ffplane-daemon-profile-"))
    site, profiles = work / "site", work / "profiles"
    site.mkdir()
    profiles.mkdir()
    (site / "sitecustomize.py").write_text(_SITE)
    saved_env = {k: os.environ.get(k) for k in ("PYTHONPATH", "FFPLANE_PROFILE_DIR", "FFPLANE_ABLATE")}
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    os.environ["FFPLANE_PROFILE_DIR"], os.environ["FFPLANE_ABLATE"] = str(profiles), ""
    jobs = LocalJobs(work, 100_000)
    try:
        jobs.prepare([], rows=8192)
        jobs.script, jobs.script_args = ABLATE, []
        jobs.post("/v1/jobs", {"name": "prof", "dataset": "tokens", "dp": 4, "batch_per_rank": 8, "seed": 0, "max_steps": jobs.steps})
        nodes = jobs.launch_job("prof", [0, 1])
        jobs.until(lambda: _saves(jobs, "prof") >= 4 * 200, 300)
        daemons = [d.pid for d in jobs.cluster.daemons]
        for pid in daemons:
            os.kill(pid, signal.SIGUSR2)
        first = _saves(jobs, "prof")
        time.sleep(args.seconds)
        for pid in daemons:
            os.kill(pid, signal.SIGUSR1)
        saves = _saves(jobs, "prof") - first
        jobs.until(lambda: all((profiles / f"{pid}.prof").exists() for pid in daemons), 30)
        time.sleep(0.5)  # written whole
        for node in nodes:
            node.kill()
        figures: dict[str, Any] = {"saves": saves}
        pairs = saves / len(daemons)  # each daemon commits its workers' saves and receives the other node's
        for i, pid in enumerate(daemons):
            st = pstats.Stats(str(profiles / f"{pid}.prof"))
            stats: dict[tuple[str, int, str], tuple[int, int, float, float, Any]] = st.stats  # type: ignore[attr-defined]
            calls = sum(v[1] for v in stats.values())
            figures[f"daemon{i}_cpu_us_per_pair"] = st.total_tt * 1e6 / pairs  # type: ignore[attr-defined]
            figures[f"daemon{i}_calls_per_pair"] = calls / pairs
            print(f"daemon {i}: {st.total_tt * 1e6 / pairs:.0f} us of CPU and {calls / pairs:.0f} Python calls a save pair (profiled)")  # type: ignore[attr-defined]
            top = sorted(stats.items(), key=lambda kv: -kv[1][2])[: args.top]
            rows = []
            for (fn, line, name), (_, nc, tt, ct, _) in top:
                where = f"{'/'.join(fn.split('/')[-2:])}:{line} {name}"
                rows.append({"function": where, "self_us": tt * 1e6 / pairs, "cum_us": ct * 1e6 / pairs, "calls": nc / pairs})
                print(f"  {tt * 1e6 / pairs:7.1f} us own {ct * 1e6 / pairs:8.1f} us with callees {nc / pairs:6.1f} calls  {where}")
            figures[f"daemon{i}_top"] = rows
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        jobs.close()
        shutil.rmtree(work, ignore_errors=True)
    config = {"seconds": args.seconds, "timer": "time.thread_time", "job": "examples/train_ffplane.py, 2 nodes x 2 workers"}
    path = write_results("daemon_profile", figures, config, {}, args.results_dir)
    print(f"wrote {path}")
    return figures


if __name__ == "__main__":
    main()
