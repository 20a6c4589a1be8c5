"""Prometheus metrics of the node daemon, read from live state at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from statestore.data_cache import DataCache
from statestore.slots import SlotStore


class _CacheCollector:
    def __init__(self, cache: DataCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[Metric]:
        labels = ["job", "dp_rank"]
        fams: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "bytes": GaugeMetricFamily("ffplane_cache_bytes", "Bytes of cached batches", labels=labels),
            "steps": GaugeMetricFamily("ffplane_cache_steps", "Cached steps", labels=labels),
            "readers": GaugeMetricFamily("ffplane_cache_readers", "Attached local readers", labels=labels),
            "lag": GaugeMetricFamily("ffplane_cache_prefetch_lag_steps", "Steps of the prefetch window not yet cached", labels=labels),
            "hits": CounterMetricFamily("ffplane_cache_hits", "Reader requests served from cache", labels=labels),
            "misses": CounterMetricFamily("ffplane_cache_misses", "Reader requests that waited for a fetch", labels=labels),
            "wait": CounterMetricFamily("ffplane_cache_reader_wait_seconds", "Time readers waited for batches", labels=labels),
        }
        for stream in list(self.cache.streams.values()):
            d = stream.describe(self.cache.config.window)
            lv = [stream.job, str(stream.dp_rank)]
            fams["bytes"].add_metric(lv, d["bytes"])
            fams["steps"].add_metric(lv, len(d["steps"]))
            fams["readers"].add_metric(lv, d["readers"])
            fams["lag"].add_metric(lv, d["prefetch_lag_steps"])
            fams["hits"].add_metric(lv, d["hits"])
            fams["misses"].add_metric(lv, d["misses"])
            fams["wait"].add_metric(lv, d["reader_wait_s"])
        yield from fams.values()
        yield CounterMetricFamily("ffplane_cache_fetched_bytes", "Bytes fetched from the data server", value=self.cache.bytes_fetched)
        yield GaugeMetricFamily("ffplane_cache_budget_bytes", "Configured shared-memory budget", value=self.cache.config.budget_bytes)


class _StateCollector:
    def __init__(self, slots: SlotStore) -> None:
        self.slots = slots

    def collect(self) -> Iterator[Metric]:
        labels = ["job", "role"]
        fams = {
            "slot": GaugeMetricFamily("ffplane_state_slot_bytes", "Bytes reserved per slot", labels=labels),
            "versions": GaugeMetricFamily("ffplane_state_committed_versions", "Committed versions held", labels=labels),
            "step": GaugeMetricFamily("ffplane_state_newest_step", "Newest committed step", labels=labels),
            "shard": GaugeMetricFamily("ffplane_state_shard_bytes", "Bytes of the newest shard (after the razor)", labels=labels),
            "block": GaugeMetricFamily("ffplane_state_save_block_seconds", "Blocking part of the newest save", labels=labels),
            "commit": GaugeMetricFamily("ffplane_state_commit_seconds", "Checksum + index of the newest commit", labels=labels),
        }
        for rs in list(self.slots.roles.values()):
            lv = [rs.job, rs.role]
            fams["slot"].add_metric(lv, rs.size)
            fams["versions"].add_metric(lv, len(rs.versions))
            for v in rs.newest(1):
                fams["step"].add_metric(lv, v.step)
                fams["shard"].add_metric(lv, v.nbytes)
                fams["block"].add_metric(lv, v.save_block_s)
                fams["commit"].add_metric(lv, v.commit_s)
        yield from fams.values()


def registry_for(cache: DataCache, slots: SlotStore) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(_CacheCollector(cache))
    registry.register(_StateCollector(slots))
    return registry
