"""One rank of bench/peers.py: saves a state with one system, or restores it in a fresh process.

    python -m bench._peers.job save    CONFIG.json   # timed saves, then saves on until SIGKILLed
    python -m bench._peers.job restore CONFIG.json   # restore the newest copy, verify, one step

RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT come from the environment, as torchrun sets them.
Every rank writes ``<out>.rank<R>.json``. Each step's state digest is appended (before its save)
to ``digests.rank<R>.jsonl``, so a restore can be checked against what was saved as that step.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench._common import cpu_s  # noqa: E402
from bench._peers import Ctx, Unavailable, peer  # noqa: E402
from bench._peers.states import build, digest, leaves  # noqa: E402

# Between saves after the timed ones, the stamp-only states spend this long "computing" (the GPT
# trains for real): a SIGKILL at a random time then lands in a save as often as a save takes of
# a step, as in a job that saves every step, not in a save every time.
LINGER_COMPUTE_S = 0.2


def _tree(root: int) -> list[int]:
    """``root`` and every process below it (a peer's helper processes are its children)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    out, frontier = [root], {root}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier}
        out.extend(frontier)
    return out


def _cpu(pids: list[int]) -> float:
    total = 0.0
    for p in pids:
        try:
            total += cpu_s(p)
        except OSError:
            pass  # ended
    return total


def _anon(pids: list[int]) -> int:
    """Private (anonymous) resident bytes of ``pids``: what they hold beyond shared files."""
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Anonymous:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def _allocated(paths: list[Path]) -> int:
    """Bytes tmpfs holds for the files under ``paths`` (allocated blocks, not apparent sizes)."""
    total = 0
    for path in paths:
        files = [path] if path.is_file() else (path.rglob("*") if path.is_dir() else [])
        for f in files:
            try:
                st = f.lstat()
                total += st.st_blocks * 512 if f.is_file() else 0
            except OSError:
                pass
    return total


def _profiler(phase: str) -> Any:
    """A running cProfile when ``PEERS_PROFILE`` names ``phase`` (save, restore): where its time
    goes, printed to the rank's log (``bench/peers.py --keep-logs``)."""
    if phase not in os.environ.get("PEERS_PROFILE", "").split(","):
        return None
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    return profile


def _report(profile: Any) -> None:
    if profile is not None:
        import pstats

        profile.disable()
        pstats.Stats(profile, stream=sys.stdout).sort_stats("cumulative").print_stats(30)


def _setup(config: dict[str, Any]) -> tuple[int, int, Any]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    state = build(config["state"], config["fsdp2_mib"], config["single_mib"])
    return rank, world, state


def _ctx(config: dict[str, Any], rank: int, world: int, replicated: bool) -> Ctx:
    node = config["nodes"][rank]
    work = Path(node["work"])
    work.mkdir(parents=True, exist_ok=True)
    return Ctx(rank, world, work, config["job"], {**config.get("system_config", {}), **node}, replicated)


def _open_peer(config: dict[str, Any], rank: int, world: int, state: Any) -> Any:
    """The rank's system, or None once it has written why it cannot run here."""
    try:
        return peer(config["system"], _ctx(config, rank, world, state.replicated))
    except Unavailable as exc:
        _write(config, rank, {"unavailable": str(exc)})
        return None


def _write(config: dict[str, Any], rank: int, what: dict[str, Any]) -> None:
    out = Path(f"{config['out']}.rank{rank}.json")
    out.with_suffix(".tmp").write_text(json.dumps(what))
    out.with_suffix(".tmp").rename(out)


def save(config: dict[str, Any]) -> None:
    rank, world, state = _setup(config)
    p = _open_peer(config, rank, world, state)
    if p is None:
        return
    form = state.dcp if p.api == "dcp" else state.local
    digests = open(Path(config["digests"]) / f"digests.rank{rank}.jsonl", "a")
    overlap = config["state"] == "gpt_ddp"  # a real loop: the next step runs while an async save finishes
    block, steps = [], []
    system_main = [0.0]  # CPU the main thread spends inside the system's calls
    mine = _tree(os.getpid())
    extra = config.get("system_pids", []) if rank == 0 else []
    anon0 = _anon(mine + extra)

    def one(n: int, timed: bool) -> float:
        p.before_step()
        t0 = time.perf_counter()
        state.step(n)
        if not state.replicated:
            dist.all_reduce(torch.zeros(1))  # a stamp-only step has no collective of its own; a real one has many
        compute_s = time.perf_counter() - t0
        c0 = time.thread_time()
        if not overlap:
            p.wait()  # outside the timer: a longer step's compute would cover the last save
        system_main[0] += time.thread_time() - c0
        digests.write(json.dumps({"step": n, "digest": digest(state.local)}) + "\n")
        digests.flush()
        t1, c1 = time.perf_counter(), time.thread_time()
        p.save(n, form)
        system_main[0] += time.thread_time() - c1
        if timed:
            block.append(time.perf_counter() - t1)
            steps.append(compute_s + block[-1])
        return t1

    one(1, timed=False)  # warm-up: first-save allocations, plans, page faults
    p.wait()
    dist.barrier()
    main0, cpu0, system_main[0] = time.thread_time(), _cpu(_tree(os.getpid()) + extra), 0.0
    extra0 = _cpu(extra)
    started = 0.0
    step = 1
    profile = _profiler("save")
    for _ in range(config["saves"]):
        step += 1
        started = one(step, timed=True)
    _report(profile)
    c0 = time.thread_time()
    p.wait()
    system_main[0] += time.thread_time() - c0
    cpu = _cpu(_tree(os.getpid()) + extra) - cpu0
    cpu_system_processes = _cpu(extra) - extra0  # the system's own processes (daemons, agents), rank 0 only
    # every process and thread counts, less the main thread's own work (the step, the digests);
    # gloo's threads (DDP's all-reduce) stay in: the "none" row's figure is that floor
    training_main = time.thread_time() - main0 - system_main[0]
    cpu_per_save = max(0.0, cpu - training_main) / config["saves"]
    replica_after = None
    if p.replicates:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if p.replicated(step):
                replica_after = time.perf_counter() - started
                break
            time.sleep(0.002)
    mine = _tree(os.getpid())
    held = {"tmpfs": _allocated(p.held_paths()), "anon": max(0, _anon(mine + extra) - anon0)}
    _write(
        config,
        rank,
        {
            "block_s": block,
            "step_s": steps,
            "cpu_per_save_s": cpu_per_save,
            "cpu_system_processes_per_save_s": cpu_system_processes / config["saves"],
            "replica_after_s": replica_after,
            "replicates": p.replicates,
            "held": held,
            "nbytes": state.nbytes,
            "last_step": step,
        },
    )
    dist.barrier()
    if config.get("corrupt") and rank == 0:
        target = p.newest_file()
        flipped = None
        if target is not None:
            at = target.stat().st_size // 2
            with open(target, "r+b") as f:
                f.seek(at)
                byte = f.read(1)
                f.seek(at)
                f.write(bytes([byte[0] ^ 0xFF]))
            flipped = {"file": str(target), "offset": at}
        _write(config | {"out": config["out"] + ".corrupt"}, rank, {"flipped": flipped})
    if config.get("linger"):  # saves go on (as training does) until the orchestrator SIGKILLs the job
        while True:
            step += 1
            if not overlap:
                time.sleep(LINGER_COMPUTE_S)  # a step's compute (on a GPU, say): the kill lands in it or in a save
            one(step, timed=False)
    p.close()
    dist.destroy_process_group()


def restore(config: dict[str, Any]) -> None:
    imported_at = time.time()
    rank, world, state = _setup(config)
    for t in leaves(state.dcp):  # nothing of the build survives: a restore must fill every byte
        t.zero_()
    p = _open_peer(config, rank, world, state)
    if p is None:
        return
    form = state.dcp if p.api == "dcp" else state.local
    ready_at = time.time()
    profile = _profiler("restore")
    t0 = time.perf_counter()
    try:
        step = p.restore(form)
        error = None
    except Exception as exc:  # noqa: BLE001 - how a system fails a restore is the finding
        step, error = None, f"{type(exc).__name__}: {exc}"[:400]
    restore_s = time.perf_counter() - t0
    _report(profile)
    got = digest(state.local) if step is not None else None
    first_step_at = None
    if step is not None:
        state.step(step + 1)  # the first training step after the restart
        first_step_at = time.time()
    _write(
        config,
        rank,
        {
            "restore_s": restore_s,
            "step": step,
            "digest": got,
            "error": error,
            "imported_at": imported_at,
            "ready_at": ready_at,
            "first_step_at": first_step_at,
        },
    )
    p.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    cmd, path = sys.argv[1], sys.argv[2]
    {"save": save, "restore": restore}[cmd](json.loads(Path(path).read_text()))
