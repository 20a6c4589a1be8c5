"""docker/prometheus-alerts.yaml and docker/grafana-dashboard.json name only metrics the servers
expose: every series they query is in a real scrape of a data server and two daemons that saved,
replicated and restored."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import torch
import yaml

from ffplane_harness.local_cluster import LocalCluster
from tests._servers import TOKEN, until
from trainer_client import Checkpointer, DataLoader
from trainer_client.jobs import Jobs

DOCKER = Path(__file__).resolve().parents[2] / "docker"
_SUFFIXES = ("_bucket", "_sum", "_count")


def _queried() -> dict[str, set[str]]:
    """metric name → where it is queried."""
    exprs: list[tuple[str, str]] = []
    for group in yaml.safe_load((DOCKER / "prometheus-alerts.yaml").read_text())["groups"]:
        exprs += [(f"alert {r['alert']}", r["expr"]) for r in group["rules"]]
    for panel in json.loads((DOCKER / "grafana-dashboard.json").read_text())["panels"]:
        exprs += [(f"panel {panel['title']!r}", t["expr"]) for t in panel["targets"]]
    out: dict[str, set[str]] = {}
    for where, expr in exprs:
        for name in re.findall(r"\bffplane_[a-z_]+", expr):
            out.setdefault(name, set()).add(where)
    return out


def test_alerts_and_dashboard_query_metrics_that_exist(tmp_path: Path, data_dir: Path) -> None:
    with LocalCluster(tmp_path, data_dir, TOKEN) as c:
        ds = c.start_dataserver()
        for _ in range(2):
            c.start_daemon(budget_mb=64)
        until(lambda: len(httpx.get(ds.url + "/v1/nodes").json()["ring"]) == 2, what="two daemons in the ring")
        Jobs(ds.url, TOKEN).create("obs", dataset="tokens", dp=1, batch_per_rank=4, max_steps=4)
        assert len(list(DataLoader("obs", 0, dataserver=ds.url, token=TOKEN, socket_path=c.socket(0)))) == 4  # the data path's series
        ck = Checkpointer("obs", socket_path=c.socket(0))
        for step in (1, 2):
            ck.save(step, {"w": torch.full((4096,), float(step))})
        ck.settle()
        ck.close()
        assert Checkpointer("obs", socket_path=c.socket(0)).restore() is not None
        c.lose_node(1)  # a detection, for the coordinator's histogram
        until(
            lambda: (
                "n1" in httpx.get(ds.url + "/v1/nodes").json()["members"]
                and not httpx.get(ds.url + "/v1/nodes").json()["members"]["n1"]["alive"]
            )
        )
        scraped = httpx.get(ds.url + "/metrics").text + httpx.get(c.daemons[0].url + "/metrics").text
    exposed = {line.split("{")[0].split(" ")[0] for line in scraped.splitlines() if line.startswith("ffplane_")}
    exposed |= {n.removesuffix(s) for n in exposed for s in _SUFFIXES if n.endswith(s)}
    missing = {name: sorted(where) for name, where in _queried().items() if name not in exposed}
    assert not missing, f"queried but not exposed (counters end in _total): {missing}"
    assert len(_queried()) >= 15  # the files query the coordinator, latencies, replication, cache, gate, data path
