"""Prometheus metrics of the node daemon, read from live state at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from statestore.data_cache import DataCache


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


def registry_for(cache: DataCache) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(_CacheCollector(cache))
    return registry
