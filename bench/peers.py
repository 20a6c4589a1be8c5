"""ffplane beside the checkpointing systems a user would pick instead: one run, the same states.

    bash bench/setup_peers.sh                     # installs the peers (DLRover, NVRx, ML Flashpoint, torchft)
    python bench/peers.py                         # 3 states x every system x 2 rounds (~35 min)
    python bench/peers.py --smoke                 # small states, 1 round, what is installed (~3 min)

States (``bench/_peers/states.py``): the example GPT's DDP state on 2 ranks (trained between
saves), an FSDP2 MLP + AdamW state of ``--fsdp2-mib`` over 2 ranks, and ``--single-mib`` held by
one rank. Systems (``bench/_peers/``), each through its own public API: ffplane's
``Checkpointer`` and ``dcp.save`` through its ``DaemonWriter``; ``torch.save`` and DCP's
``FileSystemWriter`` to tmpfs; ``dcp.async_save``; DLRover flash checkpoint; NVIDIA
resiliency-ext local checkpointing; Google ML Flashpoint; ``none`` (the loop without saves).
A system that cannot run here keeps its row, with the reason.

Every rank is a process of its own "node" (one rank per node, as replication needs two), the
systems take turns in an order rotated every round, and every system's files live on one tmpfs
mounted ``huge=within_size`` (the deployment docs/deployment.md recommends; ffplane's daemons
and the peers alike). For each state and system, per round:

* ``block_s``: what the training loop waits for per save (the slowest rank), ``--saves`` saves.
  On ``gpt_ddp`` the loop trains between saves with no wait (``step_s``, and ``overhead`` against
  ``none``); elsewhere each save waits for the last one to finish outside the timer;
* ``cpu_per_save_s``: CPU seconds per save over every process the system runs (workers, their
  helper processes and threads, ffplane's daemons), less the loop's own;
* ``held_per_role_x``: tmpfs/shm the system holds plus the anonymous memory its processes grew
  by, per role, as a multiple of the role's shard (DDP's shard: the state / ranks);
* ``replica_after_s``: from the start of the last save until a complete copy is on another node;
* then every rank is SIGKILLed mid-training and a fresh job restores: ``restore_s`` (the load,
  into the live state), ``verified`` (its bytes equal what was saved as the step it names),
  ``steps_lost``, and ``kill_to_first_step_s`` (SIGKILL until the restarted job's first step);
* last round only: one byte of the newest local copy is flipped before the restore:
  ``integrity`` says whether that was detected and routed around, refused, or restored silently.

Results: ``bench/results/peers.json`` (a ``targets`` block) and ``peers.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, huge_tmpfs, summary, write_results  # noqa: E402
from bench._peers import SYSTEMS  # noqa: E402
from bench._peers.states import STATES, WORLD  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_random = random.Random(0)  # kill moments differ from kill to kill, alike from run to run
FFPLANE = ("ffplane", "ffplane_dcp", "ffplane_dcp_full")
LIVE_PEERS = ("torchft",)  # recovery rows only: no checkpoint at rest, a live replica heals the restarted one


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _placement(system: str, world: int, base: Path, tag: str, shard_mib: int) -> Iterator[dict[str, Any]]:
    """Where each rank runs: ``nodes`` (per rank: its work folder and settings), ``prefix`` (per
    rank: a command that runs it on its node, for peers that need their own mounts), and the
    system's own processes (``system_pids``). ffplane's rows get two node daemons."""
    if system in FFPLANE:
        from ffplane_harness.local_cluster import LocalCluster

        work = base / f"{system}-{tag}"
        (work / "data").mkdir(parents=True)
        budget = max(256, 10 * shard_mib)  # slots and replicas: the daemon keeps 4 versions of each
        with LocalCluster(work, work / "data", secrets.token_hex(16), shm_parent=base) as cluster:
            cluster.start_dataserver("--log-level", "warning")
            for _ in range(2):
                cluster.start_daemon("--log-level", "warning", budget_mb=budget)
            for i in range(2):
                cluster.until_successor(i, f"n{1 - i}")
            nodes = [
                {
                    "work": str(work / f"rank{r}"),
                    "socket": str(cluster.socket(r)),
                    "url": cluster.daemons[r].url,
                    "peer_url": cluster.daemons[1 - r].url,
                    "roots": [str(cluster.roots[r])] if world == 2 else [str(p) for p in cluster.roots],
                }
                for r in range(world)
            ]
            yield {"nodes": nodes, "prefix": [[] for _ in range(world)], "system_pids": [d.pid for d in cluster.daemons]}
        return
    module = __import__(SYSTEMS[system][0], fromlist=["place"])
    if hasattr(module, "place"):  # a peer that needs more than a folder per node (namespaces)
        with module.place(world, base / f"{system}-{tag}") as placed:
            yield placed
        return
    # DCP's FileSystemWriter needs one folder every rank reaches (a shared filesystem): on one
    # host that is a folder both "nodes" see, which is kinder to it than separate nodes would be
    shared = system.startswith("dcp_")
    nodes = [{"work": str(base / f"node{0 if shared else r}" / f"{system}-{tag}")} for r in range(world)]
    yield {"nodes": nodes, "prefix": [[] for _ in range(world)]}


def _launch(cmd: str, config: dict[str, Any], placed: dict[str, Any], logs: Path) -> list[subprocess.Popen[bytes]]:
    path = Path(config["out"] + f".{cmd}.config.json")
    path.write_text(json.dumps(config))
    port = _free_port()
    procs = []
    for rank in range(config["world"]):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(config["world"])}
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        argv = [*placed["prefix"][rank], sys.executable, "-m", "bench._peers.job", cmd, str(path)]
        log = open(logs / f"{Path(config['out']).name}.{cmd}.rank{rank}.log", "ab")
        procs.append(subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def _results(
    out: str, world: int, procs: list[subprocess.Popen[bytes]], linger: bool, timeout: float = 900
) -> tuple[list[dict[str, Any]], float]:
    """Each rank's JSON, and when the job was killed: with ``linger`` it is SIGKILLed (every rank,
    by PID) at a random moment 0.2-0.6 s after all wrote, while it trains and saves on."""
    deadline = time.monotonic() + timeout
    files = [Path(f"{out}.rank{r}.json") for r in range(world)]
    try:
        while not all(f.exists() for f in files):
            dead = [p for p in procs if p.poll() not in (None, 0)]
            if (
                dead
                or time.monotonic() > deadline
                or (not linger and all(p.poll() == 0 for p in procs) and not all(f.exists() for f in files))
            ):
                raise RuntimeError(f"{out}: a rank failed (exit {[p.poll() for p in procs]}); see its log")
            time.sleep(0.05)
        if not linger:
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        else:
            time.sleep(_random.uniform(0.2, 0.6))
        return [json.loads(f.read_text()) for f in files], time.time()
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _digest_of(digests: Path, rank: int, step: int | None) -> str | None:
    if step is None:
        return None
    found = None
    for line in (digests / f"digests.rank{rank}.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["step"] == step:
            found = rec["digest"]  # the last record of a step: a save that finished before the kill
    return found


def _one(system: str, state: str, rnd: int, args: argparse.Namespace, base: Path, logs: Path, corrupt: bool) -> dict[str, Any]:
    """One round of one system on one state: saves, SIGKILL, restore (or, with ``corrupt``, a
    flipped byte in the newest local copy, then the restore)."""
    world = WORLD[state]
    tag = f"{state}-r{rnd}{'-corrupt' if corrupt else ''}"
    out = str(logs / f"{system}-{tag}")
    digests = logs / f"digests-{system}-{tag}"
    digests.mkdir()
    config: dict[str, Any] = {
        "system": system,
        "state": state,
        "world": world,
        "job": f"peers{secrets.token_hex(3)}",
        "fsdp2_mib": args.fsdp2_mib,
        "single_mib": args.single_mib,
        "saves": 2 if corrupt else args.saves,
        "digests": str(digests),
    }
    shard_mib = {"gpt_ddp": 8, "fsdp2": args.fsdp2_mib // 2 + 1, "single": args.single_mib}[state]
    try:
        return _run(system, state, world, config, out, digests, base, tag, shard_mib, logs, corrupt)
    finally:  # the run's files, so memory holds one run's at a time (a 1 GiB state leaves GiBs)
        for folder in (base / f"{system}-{tag}", *(base / f"node{r}" / f"{system}-{tag}" for r in range(world))):
            shutil.rmtree(folder, ignore_errors=True)


def _run(
    system: str,
    state: str,
    world: int,
    config: dict[str, Any],
    out: str,
    digests: Path,
    base: Path,
    tag: str,
    shard_mib: int,
    logs: Path,
    corrupt: bool,
) -> dict[str, Any]:
    with _placement(system, world, base, tag, shard_mib) as placed:
        config |= {"nodes": placed["nodes"], "system_pids": placed.get("system_pids", []), "system_config": placed.get("config", {})}
        saved, killed_at = _results(
            out, world, _launch("save", config | {"out": out, "linger": not corrupt, "corrupt": corrupt}, placed, logs), linger=not corrupt
        )
        if "unavailable" in saved[0]:
            return {"unavailable": saved[0]["unavailable"]}
        flipped = json.loads(Path(f"{out}.corrupt.rank0.json").read_text())["flipped"] if corrupt else None
        restored, _ = _results(out + ".restore", world, _launch("restore", config | {"out": out + ".restore"}, placed, logs), linger=False)
    for r, got in enumerate(restored):
        got["verified"] = got["digest"] is not None and got["digest"] == _digest_of(digests, r, got["step"])
        got["newest_begun"] = max(json.loads(line)["step"] for line in (digests / f"digests.rank{r}.jsonl").read_text().splitlines())
    return {"saved": saved, "restored": restored, "killed_at": killed_at, "flipped": flipped}


def _stat(samples: list[float | None]) -> dict[str, Any] | None:
    got = [s for s in samples if s is not None]
    return summary(got) if got else None


def _integrity(run: dict[str, Any], last_step: int) -> str:
    """What a restore did with one flipped byte in the newest local copy."""
    if run["flipped"] is None:
        return "no local copy to damage"
    got = run["restored"]
    if all(r["verified"] for r in got):
        lost = last_step - min(r["step"] for r in got)
        return (
            "detected, routed around: the newest step restored intact"
            if lost == 0
            else f"detected, routed around: restored {lost} step(s) back"
        )
    if any(r["error"] for r in got):
        return "detected, refused: " + next(r["error"] for r in got if r["error"])
    if any(r["step"] is None for r in got):
        return "nothing restored"
    return "NOT detected: restored bytes differ from what was saved"


def _figures(runs: list[dict[str, Any]], state: str) -> dict[str, Any]:
    """One system's rows on one state, from its rounds (``runs``; the last may be the corrupt one)."""
    timed = [r for r in runs if not r.get("corrupt")]
    world = WORLD[state]
    saves = [s for r in timed for s in zip(*(rank["block_s"] for rank in r["saved"]))]
    steps = [s for r in timed for s in zip(*(rank["step_s"] for rank in r["saved"]))]
    first = timed[0]["saved"][0]
    shard = first["nbytes"] / (world if state == "gpt_ddp" else 1)  # DDP: the state is the ranks' to share
    held = [sum(k["held"]["tmpfs"] + k["held"]["anon"] for k in r["saved"]) / world / shard for r in timed]
    anon = [sum(k["held"]["anon"] for k in r["saved"]) / world / shard for r in timed]
    out: dict[str, Any] = {
        "shard_bytes": shard,
        "block_s": _stat([max(s) for s in saves]),
        "step_s": _stat([max(s) for s in steps]),
        "cpu_per_save_s": _stat([sum(k["cpu_per_save_s"] for k in r["saved"]) for r in timed]),
        "cpu_system_processes_per_save_s": _stat([sum(k["cpu_system_processes_per_save_s"] for k in r["saved"]) for r in timed]),
        "held_per_role_x": _stat(held),
        "held_anon_x": _stat(anon),
        "held_bytes": [[k["held"] for k in r["saved"]] for r in timed],
        "replicates": first["replicates"],
        "replica_after_s": _stat(
            [
                max(k["replica_after_s"] for k in r["saved"]) if all(k["replica_after_s"] is not None for k in r["saved"]) else None
                for r in timed
            ]
        ),
        "restore_s": _stat([max(k["restore_s"] for k in r["restored"]) for r in timed if all(k["verified"] for k in r["restored"])]),
        "verified": [all(k["verified"] for k in r["restored"]) for r in timed],
        # from the newest step whose save had begun when the job was killed
        "steps_lost": [
            None
            if any(k["step"] is None for k in r["restored"])
            else max(k["newest_begun"] for k in r["restored"]) - min(k["step"] for k in r["restored"])
            for r in timed
        ],
        "restore_errors": sorted({k["error"] for r in timed for k in r["restored"] if k["error"]}),
        "restart_parts_s": {
            part: _stat(
                [
                    max(k[b] - (r["killed_at"] if a == "killed_at" else k[a]) for k in r["restored"])
                    for r in timed
                    if all(k["verified"] for k in r["restored"])
                ]
            )
            for part, a, b in (
                ("kill_to_imported", "killed_at", "imported_at"),
                ("imported_to_ready", "imported_at", "ready_at"),
                ("ready_to_first_step", "ready_at", "first_step_at"),
            )
        },
        "kill_to_first_step_s": _stat(
            [max(k["first_step_at"] for k in r["restored"]) - r["killed_at"] for r in timed if all(k["verified"] for k in r["restored"])]
        ),
    }
    bad = [r for r in runs if r.get("corrupt")]
    if bad:
        out["integrity"] = _integrity(bad[0], max(k["last_step"] for k in bad[0]["saved"]))
        out["integrity_flipped"] = bad[0]["flipped"]
    return out


def _best(table: dict[str, dict[str, Any]], key: str, peers: list[str], extra: Any = None) -> tuple[str, float] | None:
    """The peer with the smallest median ``key`` (that passes ``extra``), and that median."""
    got = [(p, table[p][key]["median"]) for p in peers if table[p].get(key) and (extra is None or extra(table[p]))]
    return min(got, key=lambda x: x[1]) if got else None


def _targets(figures: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's ratios, each the worst state's (ffplane against the best peer on that state)."""
    per_state: dict[str, Any] = {}
    for state, table in figures.items():
        ours = table.get("ffplane", {})
        peers = [p for p in table if p not in (*FFPLANE, "none") and "unavailable" not in table[p]]
        row: dict[str, Any] = {}
        for key, name, ok in (
            ("block_s", "save_vs_best_peer", None),
            ("restore_s", "restore_vs_best_peer", None),
            ("held_per_role_x", "memory_vs_best_replicating_peer", lambda f: f["replicates"] and f["replica_after_s"]),
        ):
            best = _best(table, key, peers, ok)
            if best and ours.get(key):
                row[name] = {"ratio": ours[key]["median"] / best[1], "best_peer": best[0], "ffplane": ours[key]["median"], "peer": best[1]}
        if table.get("ffplane_dcp", {}).get("block_s") and ours.get("block_s"):
            row["dcp_save_vs_checkpointer_save"] = {"ratio": table["ffplane_dcp"]["block_s"]["median"] / ours["block_s"]["median"]}
        per_state[state] = row
    limits = {
        "save_vs_best_peer": 0.5,
        "restore_vs_best_peer": 1.0,
        "memory_vs_best_replicating_peer": 1.0,
        "dcp_save_vs_checkpointer_save": 1.5,
    }
    targets: dict[str, Any] = {}
    for name, limit in limits.items():
        rows = {s: r[name] for s, r in per_state.items() if name in r}
        if name == "dcp_save_vs_checkpointer_save":
            rows = {s: r for s, r in rows.items() if s == "fsdp2"} or rows  # the row: the sharded state
        if rows:
            worst = max(rows, key=lambda s: rows[s]["ratio"])
            targets[name] = {
                "ratio": rows[worst]["ratio"],
                "state": worst,
                "target": f"<= {limit}",
                "met": rows[worst]["ratio"] <= limit,
                "per_state": rows,
            }
        else:  # kept, so a reader sees the figure is missing and why
            targets[name] = {
                "ratio": None,
                "target": f"<= {limit}",
                "met": None,
                "why": "no row to compare: a side did not run (see figures)",
            }
    verdicts = {s: t.get("ffplane", {}).get("integrity") for s, t in figures.items()}
    targets["integrity_routed_around"] = {
        "met": all(v and v.startswith("detected, routed around") for v in verdicts.values()),
        "per_state": verdicts,
    }
    return targets


def _chart(path: Path, figures: dict[str, dict[str, Any]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    states = list(figures)
    systems = [s for s in (*SYSTEMS, *LIVE_PEERS) if s != "none" and any(s in figures[st] for st in states)]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, key, title in zip(
        axes,
        ("block_s", "restore_s", "held_per_role_x"),
        ("blocking time per save (s, log)", "restore into a fresh process (s, log)", "host memory per role (x shard)"),
    ):
        width = 0.8 / len(systems)
        for i, system in enumerate(systems):
            xs, ys, errs = [], [], [[], []]
            for j, st in enumerate(states):
                f = figures[st].get(system, {}).get(key)
                if f:
                    xs.append(j + i * width)
                    ys.append(f["median"])
                    errs[0].append(f["median"] - f["min"])
                    errs[1].append(f["max"] - f["median"])
            color = "#c44e52" if system == "ffplane" else ("#dd8452" if system == "ffplane_dcp" else None)
            ax.bar(xs, ys, width, yerr=errs, capsize=2, label=system, color=color)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(states))], states)
        ax.set_title(title)
        if key != "held_per_role_x" and any(p.get_height() > 0 for p in ax.patches):
            ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle("ffplane beside its peers (median, min-max over rounds; missing bar: not measured, see peers.json)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist_name in ("torch", "ffplane", "dlrover", "nvidia-resiliency-ext", "ml-flashpoint", "torchft"):
        try:
            out[dist_name] = version(dist_name)
        except PackageNotFoundError:
            out[dist_name] = "not installed"
    return out


def _print(figures: dict[str, dict[str, Any]], targets: dict[str, Any]) -> None:
    for state, table in figures.items():
        print(f"--- {state}")
        print(
            f"  {'system':15s} {'block med':>10s} {'restore':>9s} {'held x':>7s} {'cpu/save':>9s} {'replica':>8s} {'kill->step':>10s}  integrity"
        )
        for system, f in table.items():
            if "unavailable" in f:
                print(f"  {system:15s} not run: {f['unavailable'][:150]}")
                continue

            def med(key: str, fmt: str = "{:.4f}") -> str:
                return fmt.format(f[key]["median"]) if f.get(key) else "-"

            print(
                f"  {system:15s} {med('block_s'):>10s} {med('restore_s'):>9s} {med('held_per_role_x', '{:.2f}'):>7s} "
                f"{med('cpu_per_save_s'):>9s} {med('replica_after_s', '{:.3f}'):>8s} {med('kill_to_first_step_s', '{:.2f}'):>10s}  {f.get('integrity', '')[:60]}"
            )
    for name, t in targets.items():
        ratio = t.get("ratio")
        print(f"  {name:36s} {'-' if ratio is None else f'{ratio:.3f}':>8s}  {t.get('target', '')}  met={t['met']}  ({t.get('state', '')})")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--states", default=",".join(STATES))
    p.add_argument(
        "--systems", default=",".join((*SYSTEMS, *LIVE_PEERS)), help="comma-separated, from: " + ", ".join((*SYSTEMS, *LIVE_PEERS))
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--saves", type=int, default=4, help="timed saves per round")
    p.add_argument("--fsdp2-mib", type=int, default=288)
    p.add_argument("--single-mib", type=int, default=1024)
    p.add_argument("--smoke", action="store_true", help="small states, 1 round, 2 saves")
    p.add_argument("--keep-logs", type=Path, help="copy every rank's log here (they are removed with the run's folder)")
    p.add_argument("--out", default="peers")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.smoke:
        args.rounds, args.saves, args.fsdp2_mib, args.single_mib = 1, 2, 24, 32
    states = args.states.split(",")
    systems = args.systems.split(",")
    for name in (*states, *systems):
        if name not in (*STATES, *SYSTEMS, *LIVE_PEERS):
            p.error(f"unknown state or system {name!r}")
    live = [n for n in systems if n in LIVE_PEERS]
    systems = [n for n in systems if n not in LIVE_PEERS]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s: {n: [] for n in systems} for s in states}
    unavailable: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="ffplane-peers-", dir="/tmp") as tmp:
        logs = Path(tmp) / "logs"
        logs.mkdir()
        size_mb = 4 * (args.single_mib * 10 + args.fsdp2_mib * 4) + 2048
        with huge_tmpfs(Path(tmp) / "shm", size_mb, "auto") as huge:
            base = huge or Path("/dev/shm") / f"ffplane-peers-{os.getpid()}"
            base.mkdir(exist_ok=True)
            try:
                for rnd in range(args.rounds):
                    order = systems[rnd % len(systems) :] + systems[: rnd % len(systems)]  # rotated: no system always goes first
                    for state in states:
                        for system in order:
                            if system in unavailable:
                                continue
                            for corrupt in (False, True) if rnd == args.rounds - 1 and system != "none" else (False,):
                                print(
                                    f"round {rnd + 1}/{args.rounds}  {state:8s} {system}{' (a byte flipped)' if corrupt else ''}",
                                    flush=True,
                                )
                                try:
                                    got = _one(system, state, rnd, args, base, logs, corrupt)
                                except (RuntimeError, OSError) as exc:
                                    tail = _log_tail(logs, system, state)
                                    got = {"failed": f"{exc}; {tail}"}
                                if "unavailable" in got:
                                    unavailable[system] = got["unavailable"]
                                    break
                                runs[state][system].append(got | {"corrupt": corrupt})
            finally:
                if not huge:
                    shutil.rmtree(base, ignore_errors=True)
                if args.keep_logs:
                    shutil.copytree(logs, args.keep_logs, dirs_exist_ok=True)
        figures = {
            state: {
                system: (
                    {"unavailable": unavailable[system]}
                    if system in unavailable and not runs[state][system]
                    else _figures_or_failure(runs[state][system], state)
                )
                for system in systems
            }
            for state in states
        }
    if "torchft" in live and "gpt_ddp" in figures:  # its own job shape: two replica groups, after the interleaved rounds
        figures["gpt_ddp"]["torchft"] = _torchft_row(args.rounds)
    _overheads(figures)
    targets = _targets(figures)
    _print(figures, targets)
    config = {
        "states": states,
        "systems": systems,
        "rounds": args.rounds,
        "saves": args.saves,
        "fsdp2_mib": args.fsdp2_mib,
        "single_mib": args.single_mib,
        "versions": _versions(),
        "command": "python bench/peers.py " + " ".join(argv or sys.argv[1:]),
    }
    out = write_results(args.out, figures, config, targets, args.results_dir)
    _chart(args.results_dir / f"{args.out}.png", figures)
    print(f"wrote {out}")
    return {"figures": figures, "targets": targets}


def _figures_or_failure(runs: list[dict[str, Any]], state: str) -> dict[str, Any]:
    failed = [r["failed"] for r in runs if "failed" in r]
    good = [r for r in runs if "failed" not in r]
    if not good or all(r.get("corrupt") for r in good):
        return {"unavailable": "every run failed: " + (failed[0] if failed else "not run")}
    out = _figures(good, state)
    if failed:
        out["failures"] = failed
    return out


def _torchft_row(rounds: int) -> dict[str, Any]:
    """torchft's live-peer recovery on the GPT (bench/_peers/torchft_recovery.py) in this table's
    terms: the heal is its restore; there is no save, no copy at rest and so nothing to flip."""
    from bench._peers import torchft_recovery

    print("torchft: live peer recovery on gpt_ddp", flush=True)
    with tempfile.TemporaryDirectory(prefix="ffplane-peers-torchft-", dir="/tmp") as tmp:
        got = torchft_recovery.measure(rounds, Path(tmp))
    if "unavailable" in got:
        return {"unavailable": got["unavailable"]}
    return {
        "system": got["system"],
        "replicates": True,  # the other replica group holds the whole state, live
        "replica_after_s": None,
        "restore_s": got["heal_s"],
        "kill_to_first_step_s": got["kill_to_first_step_s"],
        "steps_lost": got["steps_lost"]["samples"],
        "verified": [got["verified"]] * rounds,
        "integrity": "no copy at rest to damage: the state is streamed from the live peer (torch.save over HTTP, no checksum)",
        "step_s_vs_plain_ddp": got["step_s"]["ratio_of_medians"],
        "torchft": got,
    }


def _overheads(figures: dict[str, dict[str, Any]]) -> None:
    """Step time with a save every step against the loop without saves (``none``), and CPU per
    save less the loop's own (``none``'s threads: DDP's all-reduce)."""
    for state, table in figures.items():
        base = table.get("none", {})
        for system, f in table.items():
            if system == "none" or "unavailable" in f:
                continue
            if state == "gpt_ddp" and base.get("step_s") and f.get("step_s"):  # elsewhere a "step" is a stamp
                f["overhead"] = f["step_s"]["median"] / base["step_s"]["median"] - 1
            if base.get("held_anon_x") and f.get("held_per_role_x"):  # the loop's own growth is no system's
                f["held_per_role_x"] = {
                    k: v - base["held_anon_x"]["median"] if k != "samples" else [x - base["held_anon_x"]["median"] for x in v]
                    for k, v in f["held_per_role_x"].items()
                }
            if base.get("cpu_per_save_s") and f.get("cpu_per_save_s"):
                f["cpu_per_save_net_s"] = f["cpu_per_save_s"]["median"] - base["cpu_per_save_s"]["median"]


def _log_tail(logs: Path, system: str, state: str) -> str:
    """The last error line of each log of the failed run (a rank's exception)."""
    tails = []
    for log in sorted(logs.glob(f"{system}-{state}-*.log"), key=lambda p: p.stat().st_mtime)[-4:]:
        lines = [line for line in log.read_text(errors="replace").splitlines() if "Error" in line or "error" in line]
        if lines:
            tails.append(f"{log.name}: {lines[-1][:300]}")
    return " | ".join(tails[-2:])


if __name__ == "__main__":
    main()
