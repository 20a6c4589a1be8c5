"""Host memory a checkpoint takes, measured: the tmpfs bytes each role's copies occupy on its node
and on the rest of the cluster, as a multiple of its shard, beside what the save costs and how
long a node loss takes to recover from — for today's retention (4 slots + 3 successor files, run
from the revision before issue 42 in a worktree of its own) and the new ones, in the same run.

    python bench/memory.py                       # both states, every row, 3 repeats
    python bench/memory.py --states fsdp2 --repeats 1 --saves 6 --fsdp2-mib 64   # a quick look

States (``bench/_peers/states.py``), each on 2 ranks, one per node, on a ring of two daemons:
``gpt_ddp`` — the example GPT under DDP (razored: each rank saves half), trained a step between
saves; ``fsdp2`` — a ``--fsdp2-mib`` (256) MLP + AdamW sharded by FSDP2. Rows:

* ``today`` — the revision ``--today`` (before issue 42): 4 slots + 3 replica files per role;
* ``default`` — ``--versions 2`` with settled saves (``settle_all()`` before each step's collective);
* ``unsettled`` — the same daemons, saves nobody settles (a third copy each side);
* ``versions3`` — ``--versions 3``, settled;
* ``parity2``, ``parity4`` — ``--parity-k 2`` on 4 nodes and ``--parity-k 4`` on 8 (every node in
  a whole group), beside ``today_w4`` and ``today_w8``: today's retention on as many nodes.

Per row: ``memory_multiple`` (``node``: the role's slot files on its own node; ``rest``: its
replica files on the other node; ``total``), ``save_block_s`` (the save call), ``cpu_per_save_s``
(workers and daemons, less the training step's own CPU), ``recovery_s`` (node 1 lost — daemon
SIGKILLed, shared memory wiped, a replacement started — then both ranks restore, the slower one's
``restore()``; bitwise-checked against the digest saved with that step), each min/median/max over
``--repeats``, and each as a ratio to ``today`` of the same state. Writes bench/results/memory.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

ROWS = ("today", "default", "unsettled", "versions3", "today_w4", "parity2", "today_w8", "parity4")
STATES = ("gpt_ddp", "fsdp2")
TODAY = "bb7b192"  # main before issue 42: 4 slots and 3 successor files per role
_DAEMON_ARGS = {"versions3": ["--versions", "3"], "parity2": ["--parity-k", "2"], "parity4": ["--parity-k", "4"]}
# ranks (one per node) each row runs on: parity needs more nodes than a group (k + 1), and with
# 2k every node is a member of a whole group; today's retention is measured at each world too
WORLDS = {"today_w4": 4, "parity2": 4, "today_w8": 8, "parity4": 8}
BASELINE = {"today_w4": "today_w4", "parity2": "today_w4", "today_w8": "today_w8", "parity4": "today_w8"}


# --- one rank (a process of its own, the tree's code) ------------------------------------------
def _rank(config: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from bench._common import cpu_s
    from bench._peers.states import build, digest, leaves
    from trainer_client import Checkpointer, Layout
    from trainer_client.checkpointer import settle_all

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    state = build(config["state"], config["fsdp2_mib"], 1)
    layout = Layout(dp=world, dp_rank=rank) if state.replicated else Layout(tp=world, tp_rank=rank)
    ck = Checkpointer("job", layout, socket_path=config["sockets"][rank])
    out: dict[str, Any] = {}
    if config["phase"] == "restore":
        for t in leaves(state.dcp):
            t.zero_()
        t0 = time.perf_counter()
        got = ck.restore(into=state.local)
        out = {"restore_s": time.perf_counter() - t0, "step": got and got.step, "digest": digest(state.local)}
    else:
        digests, block, step_cpu = {}, [], 0.0
        cpu0 = cpu_s(os.getpid())
        for step in range(1, config["saves"] + 1):
            if config["settle"]:
                settle_all()  # before the step's collective (DDP's all-reduce; a stand-in for FSDP2's)
            c0 = time.thread_time()
            state.step(step)
            if not state.replicated:
                dist.all_reduce(torch.zeros(1))  # the stamp-only step has no collective of its own
            step_cpu += time.thread_time() - c0
            digests[step] = digest(state.local)
            t0 = time.perf_counter()
            ck.save(step, state.local)
            block.append(time.perf_counter() - t0)
        ck.wait()
        out = {"block_s": block, "cpu_s": cpu_s(os.getpid()) - cpu0 - step_cpu, "digests": digests, "nbytes": state.nbytes}
    ck.close()
    Path(config["out"]).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def _ranks(config: dict[str, Any], phase: str, sockets: list[str], work: Path) -> list[dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, outs = [], []
    world = len(sockets)
    for r in range(world):
        out = work / f"{phase}.rank{r}.json"
        out.unlink(missing_ok=True)
        cfg = {**config, "phase": phase, "sockets": sockets, "out": str(out)}
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env["PYTHONPATH"] = config["tree"]
        procs.append(subprocess.Popen([sys.executable, "-m", "bench.memory", "--rank", json.dumps(cfg)], cwd=config["tree"], env=env))
        outs.append(out)
    try:
        for p in procs:
            if p.wait(timeout=600) != 0:
                raise RuntimeError(f"a {phase} rank exited {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads(o.read_text()) for o in outs]


# --- one trial: a ring of two daemons, saves, the tmpfs read, a node lost, restores -------------
def _allocated(path: Path) -> int:
    total = 0
    for f in path.rglob("*") if path.is_dir() else []:
        try:
            st = f.lstat()
        except OSError:
            continue
        if f.is_file() and not f.name.endswith(".json"):  # sidecars and static parts are a few KiB
            total += st.st_blocks * 512
    return total


@contextlib.contextmanager
def _workdir() -> Iterator[str]:
    """A trial's folder, removed after it (kept with ``BENCH_KEEP=1``: the daemons' logs)."""
    tmp = tempfile.mkdtemp(prefix="ffplane-memory-")
    try:
        yield tmp
    finally:
        if not os.environ.get("BENCH_KEEP"):
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _cluster(work: Path) -> Iterator[Any]:
    from ffplane_harness.local_cluster import LocalCluster

    (work / "data").mkdir()
    with LocalCluster(work, work / "data", secrets.token_hex(16)) as c:
        # 8 ranks and 9 daemons on a 2-core machine starve heartbeats for more than the default
        # 1.5 s: a live node declared dead mid-restore is a failure this benchmark does not measure
        c.start_dataserver("--dead-after-s", "8")
        yield c


def _trial(config: dict[str, Any]) -> dict[str, Any]:
    import httpx

    from bench._common import cpu_s

    row, extra, world = config["row"], _DAEMON_ARGS.get(config["row"], []), WORLDS.get(config["row"], 2)
    with _workdir() as tmp, _cluster(Path(tmp)) as c:
        for _ in range(world):
            c.start_daemon(*extra, budget_mb=config["budget_mb"])
        for i in range(world):
            c.until_successor(i, f"n{(i + 1) % world}")
        sockets = [str(c.socket(i)) for i in range(world)]
        daemons = [d.pid for d in c.daemons]
        cpu0 = sum(cpu_s(p) for p in daemons)
        saved = _ranks({**config, "settle": row != "unsettled"}, "save", sockets, Path(tmp))
        last = config["saves"]
        status = f"{c.dataserver.url}/v1/jobs/job/status"
        deadline = time.monotonic() + 60  # every role's newest step on another node before the tmpfs is read
        while time.monotonic() < deadline:
            where = httpx.get(status).json().get("shard_locations", {})
            if len(where) == world and all(len(steps.get(str(last), [])) >= 2 for steps in where.values()):
                break
            time.sleep(0.05)
        time.sleep(0.5)  # a push's file retiring lags its answer by a moment
        daemon_cpu = sum(cpu_s(p) for p in daemons) - cpu0
        states = [httpx.get(c.daemons[i].url + "/v1/state").json() for i in range(world)]
        memory = _memory(c, states, world)
        # node 1 is lost with its rank; every rank restores, rank 1 on a replacement node
        c.lose_node(1)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "n1" not in httpx.get(status).json().get("dead", []):
            time.sleep(0.1)
        c.start_daemon(*extra, budget_mb=config["budget_mb"], index=world)
        restored = _ranks(config, "restore", [sockets[0], str(c.socket(world)), *sockets[2:]], Path(tmp))
    bitwise = all(got["step"] == last and got["digest"] == s["digests"][str(last)] for got, s in zip(restored, saved))
    return {
        "memory": memory,
        "save_block_s": sorted(b for s in saved for b in s["block_s"][1:])[len(saved) * (last - 1) // 2],  # median, first save out
        "cpu_per_save_s": (sum(s["cpu_s"] for s in saved) + daemon_cpu) / (last * world),
        "recovery_s": max(got["restore_s"] for got in restored),
        "restored_step": [got["step"] for got in restored],
        "bitwise": bitwise,
        "world": world,
    }


def _memory(c: Any, states: list[dict[str, Any]], world: int) -> list[dict[str, Any]]:
    """Per role, measured in tmpfs: its slots on its node, and on the other nodes its replica
    files or its share of the parity accumulators that can rebuild it (a holder's parity bytes
    over the roles they cover)."""
    shard = {r["role"]: r["versions"][0]["nbytes"] for st in states for r in st["roles"]}
    share: dict[str, float] = {}
    for j, st in enumerate(states):
        covers = [name.split("/", 1)[1] for name in (st.get("parity") or {}).get("covers", [])]
        for r in covers:
            share[r] = share.get(r, 0.0) + _allocated(c.roots[j] / "job" / "parity") / len(covers)
    out = []
    for i, r in enumerate(sorted(shard)):
        node = _allocated(c.roots[i] / "job" / "state" / r)
        rest = sum(_allocated(c.roots[j] / "job" / "replica" / r) for j in range(world) if j != i) + share.get(r, 0.0)
        out.append({"role": r, "shard": shard[r], "node": node / shard[r], "rest": rest / shard[r], "total": (node + rest) / shard[r]})
    return out


# --- the orchestrator ---------------------------------------------------------------------------
def _tree_for(row: str, today: Path) -> Path:
    return today if row.startswith("today") else ROOT


def _worktree(rev: str, where: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(where), rev], check=True, capture_output=True)
    shutil.copy(Path(__file__), where / "bench" / "memory.py")  # this file measures either revision
    return where


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from bench._common import summary, write_results

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--states", default=",".join(STATES))
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--saves", type=int, default=8)
    p.add_argument("--fsdp2-mib", type=int, default=256)
    p.add_argument("--today", default=TODAY, help="the revision measured as today's retention")
    p.add_argument("--out", default="memory")
    args = p.parse_args(argv)
    states, rows = args.states.split(","), args.rows.split(",")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s: {r: [] for r in rows} for s in states}
    with tempfile.TemporaryDirectory(prefix="ffplane-today-") as wt:
        todays = any(r.startswith("today") for r in rows)
        today = _worktree(args.today, Path(wt) / "tree") if todays else ROOT
        try:
            for rep in range(args.repeats):
                for state in states:
                    for row in rows:  # alternated, so drift falls on every row alike
                        tree = _tree_for(row, today)
                        cfg = {
                            "state": state,
                            "row": row,
                            "saves": args.saves,
                            "fsdp2_mib": args.fsdp2_mib,
                            "tree": str(tree),
                            "budget_mb": 4096,
                        }
                        env = {**os.environ, "PYTHONPATH": str(tree)}
                        done = subprocess.run(
                            [sys.executable, "-m", "bench.memory", "--trial", json.dumps(cfg)],
                            cwd=tree,
                            env=env,
                            capture_output=True,
                            text=True,
                            timeout=900,
                        )
                        if done.returncode != 0:
                            raise RuntimeError(f"{state}/{row} failed:\n{done.stderr[-3000:]}")
                        got = json.loads(done.stdout.strip().splitlines()[-1])
                        runs[state][row].append(got)
                        total = max(m["total"] for m in got["memory"])
                        print(
                            f"[{rep + 1}/{args.repeats}] {state:8s} {row:10s} {total:5.2f}x  recovery {got['recovery_s']:.3f} s  bitwise {got['bitwise']}",
                            flush=True,
                        )
        finally:
            if todays:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(today)], capture_output=True)
    figures: dict[str, Any] = {}
    for state in states:
        figures[state] = {}
        for row in rows:
            got = runs[state][row]
            fig = {
                "memory_multiple": {part: summary([max(m[part] for m in g["memory"]) for g in got]) for part in ("node", "rest", "total")},
                "save_block_s": summary([g["save_block_s"] for g in got]),
                "cpu_per_save_s": summary([g["cpu_per_save_s"] for g in got]),
                "recovery_s": summary([g["recovery_s"] for g in got]),
                "shard_bytes": got[0]["memory"][0]["shard"],
                "bitwise": all(g["bitwise"] for g in got),
            }
            figures[state][row] = fig
        for row in rows:
            base_row = BASELINE.get(row, "today")
            if base_row in rows:
                base, fig = figures[state][base_row], figures[state][row]
                fig["vs_today"] = {
                    k: round(fig[k]["median"] / base[k]["median"], 3) if base[k]["median"] else None
                    for k in ("save_block_s", "cpu_per_save_s", "recovery_s")
                } | {"memory_total": round(fig["memory_multiple"]["total"]["median"] / base["memory_multiple"]["total"]["median"], 3)}
    targets = _targets(figures, states, rows)
    _print(figures, states, rows)
    path = write_results(
        args.out, figures, {**vars(args), "worlds": {r: WORLDS.get(r, 2) for r in rows}, "one_rank_per_node": True}, targets
    )
    print(f"wrote {path}")
    return {"figures": figures, "targets": targets}


def _targets(figures: dict[str, Any], states: list[str], rows: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "default" in rows:
        worst = max(figures[s]["default"]["memory_multiple"]["total"]["max"] for s in states)
        out["default_memory_multiple"] = {"ratio": round(worst, 3), "target": 4.0, "met": worst <= 4.0 + 1e-6}
    if "default" in rows and "today" in rows:
        worst = max(figures[s]["default"]["vs_today"]["recovery_s"] for s in states)
        out["default_recovery_vs_today"] = {"ratio": worst, "target": 1.1, "met": worst <= 1.1}
    if "parity4" in rows:
        worst = max(figures[s]["parity4"]["memory_multiple"]["total"]["max"] for s in states)
        out["parity_k4_memory_multiple"] = {"ratio": round(worst, 3), "target": 3.0, "met": worst <= 3.0 + 1e-6}
    out["bitwise"] = all(figures[s][r]["bitwise"] for s in states for r in rows)
    return out


def _print(figures: dict[str, Any], states: list[str], rows: list[str]) -> None:
    print(
        f"\n{'state/row':22s} {'node':>6s} {'rest':>6s} {'total':>6s} {'block ms':>9s} {'cpu ms':>8s} {'recov s':>8s}  vs today (block, cpu, recovery)"
    )
    for s in states:
        for r in rows:
            f = figures[s][r]
            m = f["memory_multiple"]
            vs = f.get("vs_today", {})
            print(
                f"{s + '/' + r:22s} {m['node']['median']:6.2f} {m['rest']['median']:6.2f} {m['total']['median']:6.2f} "
                f"{f['save_block_s']['median'] * 1e3:9.2f} {f['cpu_per_save_s']['median'] * 1e3:8.2f} {f['recovery_s']['median']:8.3f}  "
                f"{vs.get('save_block_s')}, {vs.get('cpu_per_save_s')}, {vs.get('recovery_s')}"
            )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--rank":
        _rank(json.loads(sys.argv[2]))
    elif len(sys.argv) == 3 and sys.argv[1] == "--trial":
        print(json.dumps(_trial(json.loads(sys.argv[2]))))
    else:
        main()
