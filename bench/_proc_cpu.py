"""Where a run's CPU goes, by kind of process: a thread snapshots the CPU seconds of every
process below this one a few times a second, and ``per_step`` turns two snapshots into CPU
milliseconds per training step for each kind (workers, node daemons, data servers, ...).

On a machine whose cores the whole cluster shares, a step's time is roughly the CPU all of them
spend on it divided by the cores, so this says which process a slower variant pays in.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench._common import cpu_s

# what a process's command line says it is (first match wins); anything else is "other"
KINDS = (
    ("node daemon", "statestore serve"),
    ("data server", "dataserver serve"),
    ("zygote", "warm_start --serve"),
    ("worker", "warm_start"),
    ("worker", "_job.py"),
    ("floor sink", "_floor_sink"),  # the floor variant's receiving end: a daemon's receive at its least
    ("torchrun agent", "torch.distributed.run"),
    ("etcd", "etcd"),
)


def _kind(cmdline: str) -> str:
    return next((kind for kind, mark in KINDS if mark in cmdline), "other")


@dataclass
class _Snapshot:
    t: float  # time.time(), as the job's events stamp steps
    cpu: dict[int, tuple[str, float]] = field(default_factory=dict)  # pid → (kind, CPU seconds)


def _snapshot(root: int, skip: frozenset[int] = frozenset()) -> _Snapshot:
    parents: dict[int, int] = {}  # pid → parent
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # a process that just ended
    snap, frontier = _Snapshot(time.time()), {root}
    while frontier:
        kids = {p for p, pp in parents.items() if pp in frontier and p not in skip}
        for p in kids:
            try:
                cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                snap.cpu[p] = (_kind(cmd), cpu_s(p))  # the scheduler's ns counts, as every bench reads CPU
            except OSError:
                continue
        frontier = kids
    return snap


class CpuSampler:
    """Snapshots of every process below this one, every ``every_s``, while in a ``with`` block;
    ``skip``: processes left out with everything below them (another cluster's, idle)."""

    def __init__(self, every_s: float = 0.25, skip: frozenset[int] = frozenset()) -> None:
        self.every_s = every_s
        self.skip = skip
        self.snapshots: list[_Snapshot] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        root = os.getpid()
        while not self._stop.is_set():
            self.snapshots.append(_snapshot(root, self.skip))
            self._stop.wait(self.every_s)

    def per_step(self, step_times: list[float], ranks: int) -> dict[str, float]:
        """CPU ms per step by kind, between the first snapshot after the run got going (every
        rank's first step done) and the last one before its last step; ``step_times``: when each
        rank finished each step. A process counts if it lived through the whole window (workers
        that restarted inside it would be missed: these runs have no failures). Empty when the
        run was too short to hold two snapshots (a smoke run)."""
        times = [s.t for s in self.snapshots]
        done = sorted(step_times)
        start = bisect.bisect_right(times, done[ranks - 1])
        end = bisect.bisect_left(times, done[-1]) - 1
        if end <= start:
            return {}
        a, b = self.snapshots[start], self.snapshots[end]
        steps = (bisect.bisect_right(done, b.t) - bisect.bisect_right(done, a.t)) / ranks
        if steps <= 0:  # steps slower than the snapshots: none finished between the two
            return {}
        out: dict[str, float] = {}
        for pid, (kind, cpu) in b.cpu.items():
            if pid in a.cpu:
                out[kind] = out.get(kind, 0.0) + (cpu - a.cpu[pid][1]) * 1e3 / steps
        return out
