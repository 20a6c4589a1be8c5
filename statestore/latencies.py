"""Latency histograms of the node daemon (served on its ``/metrics`` with the other figures)."""

from __future__ import annotations

from prometheus_client import Histogram

__all__ = ["Latencies", "Parts"]


class Latencies:
    """Histograms of what training waits on: a save's blocking copy (as the worker reported it),
    the daemon's commit, a push to the successor, a worker's restore (incl. pulls from peers)."""

    BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

    def __init__(self) -> None:
        def h(name: str, what: str) -> Histogram:
            return Histogram(name, what, buckets=self.BUCKETS, registry=None)

        self.save_block = h("ffplane_state_save_block_duration_seconds", "Blocking part of each save, in the worker")
        self.commit = h("ffplane_state_commit_duration_seconds", "Checksum + index record of each commit, in the daemon")
        self.replication = h("ffplane_replication_push_duration_seconds", "Each shard pushed to the ring successor")
        self.restore = h("ffplane_state_restore_duration_seconds", "Each worker restore's lookup, including pulls from peers")

    def all(self) -> list[Histogram]:
        return [self.save_block, self.commit, self.replication, self.restore]


class Parts:
    """Where the time of a repeated operation goes, part by part: the fixed per-save costs
    ``/v1/state`` shows (mean microseconds) and ``bench/save_cpu.py`` sets beside their floors."""

    def __init__(self) -> None:
        self.count = 0
        self._seconds: dict[str, float] = {}

    def add(self, part: str, seconds: float) -> None:
        self._seconds[part] = self._seconds.get(part, 0.0) + seconds

    def done(self) -> None:
        self.count += 1

    def describe(self) -> dict[str, float]:
        n = max(self.count, 1)
        return {"count": self.count, **{f"{k}_us": round(v / n * 1e6, 1) for k, v in self._seconds.items()}}
