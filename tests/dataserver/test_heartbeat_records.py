"""One job's bad record in a node's heartbeat is dropped, not the heartbeat (issue 39): the node
stays alive in the ring, its other jobs' records are applied, the answer names what was dropped
and why, and the data server's log says it once per node and job. Over HTTP and over UDP."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import httpx

from ffplane_contract import heartbeat as co
from ffplane_harness.local_cluster import LocalCluster, Proc
from tests._servers import TOKEN, until

AUTH = {"Authorization": f"Bearer {TOKEN}"}
ROLE = "dp0-pp0-tp0"


def _version(step: Any) -> dict[str, Any]:
    return {"step": step, "checksum": "0" * 16, "nbytes": 1, "layout_roles": [ROLE]}


def _beat(ds: Proc, inventory: dict[str, Any], **extra: Any) -> httpx.Response:
    body = {"node_id": "n0", "address": "http://127.0.0.1:9", "budget_bytes": 1, "inventory": inventory, **extra}
    return httpx.post(ds.url + "/v1/nodes/heartbeat", json=body, headers=AUTH)


def _restorable(ds: Proc, job: str) -> int | None:
    step: int | None = httpx.get(f"{ds.url}/v1/jobs/{job}/status").json()["restorable_step"]
    return step


def _dropped_lines(ds: Proc) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in ds.log().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("msg", "").startswith("heartbeat record dropped")]


def test_a_bad_record_over_http_is_dropped_and_the_node_and_the_other_jobs_records_are_taken(tmp_path: Path, data_dir: Path) -> None:
    with LocalCluster(tmp_path, data_dir, TOKEN) as c:
        ds = c.start_dataserver()
        r = _beat(ds, {"good": {ROLE: [_version(3)]}, "bad": {ROLE: [_version(2**60)]}})
        assert r.status_code == 200, r.text  # was 422 for the whole heartbeat
        answer = r.json()
        assert answer["ring"] == ["n0"] and answer["dropped_count"] == 1, answer
        (dropped,) = answer["dropped"]
        assert dropped["job"] == "bad" and dropped["record"] == f"inventory.bad.{ROLE}[0]" and "step" in dropped["reason"], dropped
        assert _restorable(ds, "good") == 3 and _restorable(ds, "bad") is None
        # the node keeps beating with the bad record (and more) past --dead-after-s (1.5 s): it stays
        # alive, and the good job's restorable step advances
        until_s = time.monotonic() + 2.5
        step = 3
        while time.monotonic() < until_s:
            step += 1
            inventory = {
                "good": {ROLE: [_version(step), _version(step - 1)]},
                "bad": {ROLE: [_version(2**60)], "no/role": [_version(1)]},
                "other": {ROLE: [_version("7")]},
            }
            r = _beat(ds, inventory, workers=[{"pid": 1, "job": "good"}, {"pid": -1, "job": "other"}])
            assert r.status_code == 200 and r.json()["dropped_count"] == 4, r.text
            time.sleep(0.3)
        cluster = httpx.get(ds.url + "/v1/cluster").json()
        assert cluster["members"]["n0"]["alive"] is True and cluster["ring"] == ["n0"], cluster
        assert _restorable(ds, "good") == step and _restorable(ds, "other") is None
        status = httpx.get(ds.url + "/v1/jobs/good/status").json()
        assert status["members"]["n0"]["workers"] == [{"pid": 1, "job": "good"}]
        # logged once per node and job, naming the record and why; every drop is counted
        lines = _dropped_lines(ds)
        assert sorted(line["job"] for line in lines) == ["bad", "other"], lines
        bad = next(line for line in lines if line["job"] == "bad")
        assert bad["node"] == "n0" and f"inventory.bad.{ROLE}[0]" in bad["msg"] and "less than" in bad["reason"], bad
        metrics = httpx.get(ds.url + "/metrics").text
        counted = next(float(x.split()[1]) for x in metrics.splitlines() if x.startswith("ffplane_coordinator_records_dropped_total"))
        assert counted >= 1 + 4 * 5


def test_a_bad_record_over_udp_is_dropped_and_the_other_jobs_records_are_taken(tmp_path: Path, data_dir: Path) -> None:
    with LocalCluster(tmp_path, data_dir, TOKEN) as c:
        ds = c.start_dataserver()
        key, session = TOKEN.encode(), os.urandom(8)
        udp = {"session": session.hex(), "counter": 0, "inv_version": 0}
        r = _beat(ds, {}, udp=udp)
        assert r.status_code == 200, r.text
        view = r.json()
        inventory = {"good": {ROLE: [_version(7)]}, "bad": {ROLE: [_version(2**60)]}, "odd": {ROLE: [_version("5")]}}
        payload = co.encode_inventory(inventory, [{"pid": 1}, {"pid": "x"}])
        beat = co.Beat(co.KIND_INV, "n0", session, 1, 1, view["epoch"], view["version"], payload)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.settimeout(10)
            sock.sendto(beat.encode(key), ("127.0.0.1", view["udp_port"]))
            answer = co.Answer.decode(key, sock.recv(65536))
        assert answer is not None and answer.status == co.STATUS_OK
        assert _restorable(ds, "good") == 7
        # read as an HTTP heartbeat's records are: a step out of range or a string step is no step
        assert _restorable(ds, "bad") is None and _restorable(ds, "odd") is None
        status = httpx.get(ds.url + "/v1/jobs/good/status").json()
        assert status["members"]["n0"]["alive"] and status["members"]["n0"]["workers"] == [{"pid": 1}]
        lines = until(lambda: len(found := _dropped_lines(ds)) >= 3 and found, what="the dropped records logged")
        assert sorted(line["job"] for line in lines) == ["", "bad", "odd"], lines
        assert any(f"inventory.bad.{ROLE}[0]" in line["msg"] for line in lines), lines
