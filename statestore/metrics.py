"""Prometheus metrics of the node daemon, read from live state at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from statestore.data_cache import DataCache
from statestore.latencies import Latencies
from statestore.link_gate import LinkGate
from statestore.slots import SlotStore
from statestore.state_service import StateService
from statestore.transport import BulkServer

Family = GaugeMetricFamily | CounterMetricFamily
_GAUGE, _COUNTER = GaugeMetricFamily, CounterMetricFamily


def _families(labels: list[str], spec: dict[str, tuple[type[Family], str, str]]) -> dict[str, Family]:
    return {key: kind(name, doc, labels=labels) for key, (kind, name, doc) in spec.items()}


def _add(fams: dict[str, Family], labels: list[str], values: dict[str, float]) -> None:
    for key, value in values.items():
        fams[key].add_metric(labels, value)


class _CacheCollector:
    SPEC: dict[str, tuple[type[Family], str, str]] = {
        "bytes": (_GAUGE, "ffplane_cache_bytes", "Bytes of cached batches"),
        "steps": (_GAUGE, "ffplane_cache_steps", "Cached steps"),
        "readers": (_GAUGE, "ffplane_cache_readers", "Attached local readers"),
        "lag": (_GAUGE, "ffplane_cache_prefetch_lag_steps", "Steps of the prefetch window not yet cached"),
        "hits": (_COUNTER, "ffplane_cache_hits", "Reader requests served from cache"),
        "misses": (_COUNTER, "ffplane_cache_misses", "Reader requests that waited for a fetch"),
        "wait": (_COUNTER, "ffplane_cache_reader_wait_seconds", "Time readers waited for batches"),
    }

    def __init__(self, cache: DataCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[Metric]:
        fams = _families(["job", "dp_rank"], self.SPEC)
        for stream in list(self.cache.streams.values()):
            d = stream.describe(self.cache.config.window)
            _add(fams, [stream.job, str(stream.dp_rank)], {
                "bytes": d["bytes"], "steps": len(d["steps"]), "readers": d["readers"], "lag": d["prefetch_lag_steps"],
                "hits": d["hits"], "misses": d["misses"], "wait": d["reader_wait_s"],
            })  # fmt: skip
        yield from fams.values()
        yield CounterMetricFamily("ffplane_cache_fetched_bytes", "Bytes fetched from the data server", value=self.cache.bytes_fetched)
        yield GaugeMetricFamily("ffplane_cache_budget_bytes", "Configured shared-memory budget", value=self.cache.config.budget_bytes)


class _StateCollector:
    SPEC: dict[str, tuple[type[Family], str, str]] = {
        "slot": (_GAUGE, "ffplane_state_slot_bytes", "Bytes reserved per slot"),
        "versions": (_GAUGE, "ffplane_state_committed_versions", "Committed versions held"),
        "step": (_GAUGE, "ffplane_state_newest_step", "Newest committed step"),
        "shard": (_GAUGE, "ffplane_state_shard_bytes", "Bytes of the newest shard (after the razor)"),
        "block": (_GAUGE, "ffplane_state_save_block_seconds", "Blocking part of the newest save"),
        "commit": (_GAUGE, "ffplane_state_commit_seconds", "Checksum + index of the newest commit"),
    }

    def __init__(self, slots: SlotStore) -> None:
        self.slots = slots

    def collect(self) -> Iterator[Metric]:
        fams = _families(["job", "role"], self.SPEC)
        for rs in list(self.slots.roles.values()):
            values: dict[str, float] = {"slot": rs.size, "versions": len(rs.versions)}
            for v in rs.newest(1):
                values |= {"step": v.step, "shard": v.nbytes, "block": v.save_block_s, "commit": v.commit_s}
            _add(fams, [rs.job, rs.role], values)
        yield from fams.values()


class _LinkCollector:
    """The link gate and replication: what crossed the network, what waited, what lags."""

    def __init__(self, gate: LinkGate, state: StateService) -> None:
        self.gate, self.state = gate, state

    def collect(self) -> Iterator[Metric]:
        g = self.gate
        yield GaugeMetricFamily("ffplane_gate_open", "1 when STATE may use the network now", value=0 if g.closed_because() else 1)
        sent = CounterMetricFamily("ffplane_gate_bytes", "STATE bytes let through the gate", labels=["priority"])
        for p, n in g.bytes_by_priority.items():
            sent.add_metric([p.name.lower()], n)
        yield sent
        yield CounterMetricFamily("ffplane_gate_paused_seconds", "Time STATE transfers waited at the gate", value=g.paused_s)
        yield CounterMetricFamily("ffplane_gate_pauses", "Times a STATE transfer had to wait", value=g.pauses)
        yield GaugeMetricFamily("ffplane_replica_bytes", "Bytes of replicas and pulled shards held", value=self.state.replicas.held_bytes())
        yield CounterMetricFamily(
            "ffplane_replica_received_bytes", "Replica bytes received from peers", value=self.state.replicas.received_bytes
        )
        yield CounterMetricFamily(
            "ffplane_restore_pulled_bytes", "Shard bytes pulled from peers for restores", value=self.state.pulled_bytes
        )
        yield CounterMetricFamily(
            "ffplane_restores_behind", "Restores that went more than one step behind the newest copy", value=self.state.restores_behind
        )
        r = self.state.replicator
        if r is None:
            return
        yield CounterMetricFamily("ffplane_replication_sent_bytes", "Bytes pushed to the ring successor", value=r.bytes_sent)
        yield CounterMetricFamily("ffplane_replication_pushes", "Shards pushed to the ring successor", value=r.pushes)
        yield CounterMetricFamily("ffplane_replication_failures", "Pushes that failed (and were resumed)", value=r.failures)
        yield CounterMetricFamily(
            "ffplane_replication_commit_wait_seconds", "Time commits waited for the previous version's replica", value=r.commit_wait_s
        )
        yield CounterMetricFamily(
            "ffplane_replication_commit_wait_timeouts", "Commits made while the replica was still behind", value=r.commit_wait_timeouts
        )
        yield CounterMetricFamily(
            "ffplane_replication_refused_for_room", "Pushes the successor refused for want of room (its budget or tmpfs)", value=r.refusals
        )
        yield GaugeMetricFamily("ffplane_replication_pending", "Committed versions waiting to be pushed", value=r.pending())
        described = r.describe()
        yield GaugeMetricFamily(
            "ffplane_replication_has_successor", "1 when the ring gives this node a successor", value=1 if described["successor"] else 0
        )
        lag = GaugeMetricFamily(
            "ffplane_replication_lag_steps",
            "Newest committed step minus the newest on the successor (before the first replica: the versions held); none without a successor",
            labels=["job", "role"],
        )
        if described["successor"]:  # with no successor there is nothing to lag behind (see ffplane_replication_has_successor)
            held = {f"{rs.job}/{rs.role}": len(rs.versions) for rs in list(self.state.slots.roles.values())}
            for key, d in described["roles"].items():
                job, role = key.split("/", 1)
                lag.add_metric([job, role], d["committed"] - d["replicated"] if d["replicated"] is not None else held.get(key, 0))
        yield lag


class _BulkCollector:
    """The bulk port: what it took, refused and closed (a flood or a stalled peer shows here)."""

    def __init__(self, bulk: BulkServer) -> None:
        self.bulk = bulk

    def collect(self) -> Iterator[Metric]:
        b = self.bulk
        yield CounterMetricFamily("ffplane_bulk_pushes_received", "Replica pushes received on the bulk port", value=b.pushes)
        yield CounterMetricFamily("ffplane_bulk_refused", "Bulk requests answered with an error", value=b.refused)
        conns = GaugeMetricFamily("ffplane_bulk_connections", "Open bulk-port connections", labels=["state"])
        conns.add_metric(["authenticated"], len(b.authed))
        conns.add_metric(["unauthenticated"], len(b.preauth))
        yield conns
        closed = CounterMetricFamily("ffplane_bulk_closed", "Bulk connections this daemon closed, by reason", labels=["reason"])
        for reason, n in b.closed.items():
            closed.add_metric([reason], n)
        yield closed


def registry_for(
    cache: DataCache,
    slots: SlotStore,
    gate: LinkGate | None = None,
    state: StateService | None = None,
    latencies: Latencies | None = None,
    bulk: BulkServer | None = None,
) -> CollectorRegistry:
    registry = CollectorRegistry()
    if bulk is not None:
        registry.register(_BulkCollector(bulk))
    for histogram in latencies.all() if latencies is not None else []:
        registry.register(histogram)
    registry.register(_CacheCollector(cache))
    registry.register(_StateCollector(slots))
    if gate is not None and state is not None:
        registry.register(_LinkCollector(gate, state))
    return registry
