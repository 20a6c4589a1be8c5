"""The data server's Prometheus metrics (``GET /metrics``): batches and bytes served per job, and
the membership its coordinator sees (only meaningful on the server that coordinates)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from dataserver.coordinator import Coordinator


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.steps = Counter("ffplane_dataserver_steps_served", "Batches (one per TID) streamed", ["job"], registry=self.registry)
        self.bytes = Counter("ffplane_dataserver_bytes_served", "Arrow IPC bytes streamed", ["job"], registry=self.registry)
        self.detection = Histogram(
            "ffplane_coordinator_detection_seconds",
            "Silence before a node was declared dead (heartbeat gap + sweep)",
            buckets=(0.5, 1, 1.5, 2, 2.5, 3, 5, 10, 30),
            registry=self.registry,
        )

    def watch(self, coordinator: Coordinator, leading: Callable[[], bool]) -> None:
        """Export ``coordinator``'s membership; ``leading``: whether this server coordinates now."""
        coordinator.on_declared_dead = self.detection.observe
        self.registry.register(_CoordinatorCollector(coordinator, leading))


class _CoordinatorCollector:
    """Membership as this server's coordinator sees it (only meaningful on the leader)."""

    def __init__(self, coordinator: Coordinator, leading: Callable[[], bool]) -> None:
        self.coordinator, self.leading = coordinator, leading

    def describe(self) -> list[Any]:
        return []  # collected fresh each scrape (the registry must not call collect() at register time)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        c = self.coordinator
        yield GaugeMetricFamily("ffplane_coordinator_leading", "1 when this data server coordinates now", value=1 if self.leading() else 0)
        members = GaugeMetricFamily("ffplane_coordinator_members", "Nodes by state", labels=["state"])
        ms = list(c.members.values())
        members.add_metric(["alive"], sum(1 for m in ms if m.alive and not m.unreachable))
        members.add_metric(["unreachable"], sum(1 for m in ms if m.unreachable))
        members.add_metric(["dead"], sum(1 for m in ms if not m.alive))
        yield members
        yield GaugeMetricFamily("ffplane_coordinator_ring_size", "Nodes in the replication ring", value=len(c.ring()))
        beats = CounterMetricFamily("ffplane_coordinator_heartbeats", "Heartbeats received, by kind", labels=["kind"])
        for kind, n in sorted(c.stats.items()):
            beats.add_metric([kind], n)
        yield beats
        yield CounterMetricFamily("ffplane_coordinator_worker_exits", "Worker exits reported by daemons", value=len(c.worker_exits))
        yield CounterMetricFamily(
            "ffplane_coordinator_records_dropped", "Heartbeat records left out for failing their check", value=c.drop_log.total
        )
