"""What /metrics says on both servers: latency histograms, the replication lag only where there
is a successor, and the coordinator's membership and detection latency."""

from __future__ import annotations

import re

import httpx
import torch

from ffplane_harness.local_cluster import LocalCluster
from tests._servers import until
from tests.statestore.conftest import start_ring
from trainer_client import Checkpointer


def _metric(text: str, name: str, labels: str = "") -> float | None:
    """The sample ``name{labels}`` in a Prometheus exposition (None when absent)."""
    pattern = rf"^{re.escape(name)}{re.escape('{' + labels + '}') if labels else ''} (\S+)$"
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else None


def _scrape(url: str) -> str:
    return httpx.get(url + "/metrics").text


def test_histograms_lag_and_coordinator_metrics(cluster: LocalCluster) -> None:
    start_ring(cluster, 1)
    d0, ds = cluster.daemons[0], cluster.dataserver
    assert ds is not None
    ck = Checkpointer("m", socket_path=cluster.socket(0))
    for step in (1, 2):
        ck.save(step, {"w": torch.full((4096,), float(step))})
    ck.wait()
    alone = _scrape(d0.url)
    assert _metric(alone, "ffplane_state_save_block_duration_seconds_count") == 2
    assert _metric(alone, "ffplane_state_commit_duration_seconds_count") == 2
    assert _metric(alone, "ffplane_state_save_block_duration_seconds_bucket", 'le="+Inf"') == 2
    assert _metric(alone, "ffplane_replication_has_successor") == 0
    assert "ffplane_replication_lag_steps{" not in alone  # no successor: no lag to report (it read 50 before)

    start_ring(cluster, 1)  # a successor: step 3 is pushed to it
    until(lambda: _metric(_scrape(d0.url), "ffplane_replication_has_successor") == 1, what="a successor")
    ck.save(3, {"w": torch.full((4096,), 3.0)})
    ck.settle()
    paired = _scrape(d0.url)
    assert _metric(paired, "ffplane_replication_lag_steps", 'job="m",role="dp0-pp0-tp0"') == 0
    assert (_metric(paired, "ffplane_replication_push_duration_seconds_count") or 0) >= 1
    ck.close()
    restored = Checkpointer("m", socket_path=cluster.socket(0)).restore()
    assert restored is not None and restored.step == 3
    assert _metric(_scrape(d0.url), "ffplane_state_restore_duration_seconds_count") == 1

    coord = _scrape(ds.url)
    assert _metric(coord, "ffplane_coordinator_leading") == 1
    assert _metric(coord, "ffplane_coordinator_members", 'state="alive"') == 2
    assert _metric(coord, "ffplane_coordinator_detection_seconds_count") == 0
    cluster.lose_node(1)
    until(lambda: _metric(_scrape(ds.url), "ffplane_coordinator_members", 'state="dead"') == 1, what="n1 declared dead")
    after = _scrape(ds.url)
    assert _metric(after, "ffplane_coordinator_detection_seconds_count") == 1
    assert (_metric(after, "ffplane_coordinator_detection_seconds_sum") or 0) >= 1.5  # never before --dead-after-s of silence
