"""The data server under hostile or careless input (issue #15): registered addresses, generations
that would rewrite history, bounds on every number and name, bodies judged before they are read,
jobs and requests too big to serve, and job records that cannot be loaded."""

from __future__ import annotations

import json
import socket
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pytest

from dataserver import Generation, Planner
from dataserver.catalog import SAMPLE_INDEX_COLUMN
from tests._servers import TOKEN, Proc, until
from tests.conftest import launcher

AUTH = {"Authorization": f"Bearer {TOKEN}"}
JOB = {"name": "j1", "dataset": "tokens", "dp": 2, "batch_per_rank": 8, "seed": 5, "max_steps": 100}


@pytest.fixture
def serve(tmp_path: Path, data_dir: Path) -> Iterator[Callable[..., Proc]]:
    """Start a data server with extra flags (state in ``tmp_path/state``); all stopped at the end."""
    with launcher(tmp_path, "dataserver") as launch:
        yield lambda *extra: launch(
            ["serve", "--data-dir", str(data_dir), "--state-dir", str(tmp_path / "state"), "--port", "0", *extra], "dataserver"
        )


def _beat(url: str, node_id: str, address: str, **extra: Any) -> httpx.Response:
    body = {"node_id": node_id, "address": address, "budget_bytes": 1, **extra}
    return httpx.post(url + "/v1/nodes/heartbeat", json=body, headers=AUTH)


def _address_of(node: str) -> str:
    """A peer address of ``node``'s own: two live nodes of one data server cannot share one."""
    return f"http://127.0.0.1:{1024 + zlib.crc32(node.encode()) % 60000}"


def _members(ds: Proc) -> dict[str, Any]:
    members: dict[str, Any] = httpx.get(ds.url + "/v1/nodes").json()["members"]
    return members


def _generation(ds: Proc, start_step: int, **extra: Any) -> httpx.Response:
    body = {"start_step": start_step, "dp": 3, "batch_per_rank": 4, **extra}
    return httpx.post(ds.url + "/v1/jobs/j1/generations", json=body, headers=AUTH)


def _fetch(ds: Proc, dp_rank: int, start: int, count: int = 1) -> httpx.Response:
    return httpx.get(f"{ds.url}/v1/jobs/j1/batches", params={"dp_rank": dp_rank, "start": start, "count": count}, headers=AUTH, timeout=60)


def _non_loopback_ip() -> str | None:
    """An address of this host that is not loopback (the source of a route to the outside)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent, only a route is chosen
        except OSError:
            return None
        ip: str = s.getsockname()[0]
    return None if ip.startswith("127.") else ip


# ---- 1. addresses peers cannot use -------------------------------------------------------------


@pytest.mark.parametrize("address", ["http://0.0.0.0:8471", "http://[::]:8471", "http://0:8471"])
def test_an_unspecified_address_is_refused_with_what_to_do(dataserver: Proc, address: str) -> None:
    r = _beat(dataserver.url, "n0", address)
    assert r.status_code == 422 and "--advertise-address" in r.json()["detail"], r.text
    assert _members(dataserver) == {}  # nothing registered


def test_a_loopback_address_is_refused_from_another_host_and_taken_from_this_one(serve: Callable[..., Proc]) -> None:
    ip = _non_loopback_ip()
    if ip is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    ds = serve("--host", "0.0.0.0")
    remote = f"http://{ip}:{ds.ready['port']}"  # requests arrive from `ip`, as from another host
    for address in ("http://127.0.0.1:8471", "http://localhost:8471", "http://[::1]:8471", "http://127.1:8471"):
        r = _beat(remote, "hA", address)
        assert r.status_code == 422 and "--advertise-address" in r.json()["detail"] and ip in r.json()["detail"], r.text
    assert _members(ds) == {}
    assert _beat(remote, "hA", f"http://{ip}:8471").status_code == 200
    # a node on the data server's own host may register loopback (the one-machine cluster)
    assert _beat(f"http://127.0.0.1:{ds.ready['port']}", "local", "http://127.0.0.1:8471").status_code == 200
    assert {n: m["address"] for n, m in _members(ds).items()} == {"hA": f"http://{ip}:8471", "local": "http://127.0.0.1:8471"}


def test_two_live_nodes_cannot_share_an_address_but_a_dead_nodes_can_be_reused(serve: Callable[..., Proc]) -> None:
    ds = serve("--dead-after-s", "0.5")
    assert _beat(ds.url, "hA", "http://10.0.0.1:8471").status_code == 200
    r = _beat(ds.url, "hB", "http://10.0.0.1:8471/")  # the same host and port
    assert r.status_code == 409 and "'hA'" in r.json()["detail"] and "--advertise-address" in r.json()["detail"], r.text
    assert set(_members(ds)) == {"hA"}
    until(lambda: not _members(ds)["hA"]["alive"], what="hA declared dead")
    assert _beat(ds.url, "hB", "http://10.0.0.1:8471").status_code == 200  # a replacement node
    assert httpx.get(ds.url + "/v1/nodes").json()["ring"] == ["hB"]


# ---- 5. generations that would rewrite history --------------------------------------------------


def test_a_generation_cannot_start_at_a_served_step_even_after_a_restart(serve: Callable[..., Proc]) -> None:
    ds = serve()
    assert httpx.post(ds.url + "/v1/jobs", json=JOB, headers=AUTH).status_code == 201
    assert _fetch(ds, 0, 0, 4).status_code == 200 and _fetch(ds, 1, 5).status_code == 200  # steps 0-3 and 5
    r = _generation(ds, 3)
    assert r.status_code == 409 and "up to step 5 have been served" in r.json()["detail"] and "step 6 or later" in r.json()["detail"], (
        r.text
    )
    ds.stop()
    ds = serve()
    r = _generation(ds, 5)
    assert r.status_code == 409 and "up to step 5" in r.json()["detail"], r.text  # the mark was persisted
    job = httpx.get(ds.url + "/v1/jobs/j1").json()
    assert [g["start_step"] for g in job["generations"]] == [0] and job["served_step"] == 5
    assert _generation(ds, 6).status_code == 200


def test_replan_served_may_replan_prefetched_steps_but_never_a_committed_one(dataserver: Proc) -> None:
    assert httpx.post(dataserver.url + "/v1/jobs", json=JOB, headers=AUTH).status_code == 201
    before = _fetch(dataserver, 0, 8).content  # prefetched up to step 9 by some node cache
    assert _fetch(dataserver, 0, 9).status_code == 200
    # a node holds state saved after step 4 for this job: steps 0-4 were trained
    inventory = {"j1": {"dp0-pp0-tp0": [{"step": 4, "checksum": "0" * 16, "nbytes": 1, "layout_roles": ["dp0-pp0-tp0"]}]}}
    assert _beat(dataserver.url, "n0", "http://127.0.0.1:9", inventory=inventory).status_code == 200
    for start_step in (3, 4):
        r = _generation(dataserver, start_step, replan_served=True)
        assert r.status_code == 409 and "step 4 of job 'j1' is committed" in r.json()["detail"], r.text
    assert _generation(dataserver, 5).status_code == 409  # served, and not said to be only prefetched
    r = _generation(dataserver, 5, replan_served=True)
    assert r.status_code == 200, r.text
    after = _fetch(dataserver, 0, 8)
    expected = Planner(300, 5, [Generation(0, 2, 8), Generation(5, 3, 4)]).plan(0, 8).indices.tolist()
    assert pa.ipc.open_stream(after.content).read_next_batch().column(SAMPLE_INDEX_COLUMN).to_pylist() == expected
    assert after.content != before


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"start_step": 100}, "max_steps 100"),  # the job's max_steps
        ({"start_step": 10**30}, "start_step"),
        ({"start_step": 2**53}, "start_step"),
        ({"start_step": 10, "dp": True}, "dp"),
        ({"start_step": 10, "replan_served": 1}, "replan_served"),
        ({"start_step": 10, "dp": 2**20, "batch_per_rank": 2**20}, "samples per step"),
    ],
)
def test_a_generation_past_max_steps_or_out_of_bounds_is_refused_and_nothing_written(
    serve: Callable[..., Proc], tmp_path: Path, body: dict[str, Any], needle: str
) -> None:
    ds = serve()
    assert httpx.post(ds.url + "/v1/jobs", json=JOB, headers=AUTH).status_code == 201
    record = (tmp_path / "state" / "j1.json").read_bytes()
    r = _generation(ds, **{"dp": 3, "batch_per_rank": 4, **body})
    assert r.status_code == 422 and needle in r.json()["detail"], r.text
    assert (tmp_path / "state" / "j1.json").read_bytes() == record
    assert len(httpx.get(ds.url + "/v1/jobs/j1").json()["generations"]) == 1
    assert _generation(ds, 10).status_code == 200  # and the job is not stuck


# ---- 6. bounds on every name and number -----------------------------------------------------------


def test_long_names_and_huge_numbers_get_a_4xx_not_a_500(dataserver: Proc) -> None:
    url = dataserver.url
    long = "a" * 256
    r = httpx.post(url + "/v1/jobs", json={**JOB, "dataset": long}, headers=AUTH)
    assert r.status_code == 422 and "dataset" in r.json()["detail"], r.text
    assert httpx.get(f"{url}/v1/datasets/{long}").status_code == 422
    assert httpx.get(f"{url}/v1/jobs/{long}").status_code == 422
    assert httpx.get(f"{url}/v1/jobs/{long}/status").status_code == 422
    big = {"name": "big", "dataset": "tokens", "dp": 1024, "batch_per_rank": 16384}  # 2**24 samples a step, no max_steps
    assert httpx.post(url + "/v1/jobs", json=big, headers=AUTH).status_code == 201
    r = httpx.get(url + "/v1/jobs/big/plan", params={"dp_rank": 0, "step": 2**61})
    assert r.status_code == 422 and "step" in r.json()["detail"], r.text
    r = httpx.get(url + "/v1/jobs/big/plan", params={"dp_rank": 0, "step": 2**52})  # within the schema, past the plan's range
    assert r.status_code == 416 and "beyond the plan's range" in r.json()["detail"], r.text
    r = httpx.get(url + "/v1/jobs/big/batches", params={"dp_rank": 0, "start": 2**52}, headers=AUTH)
    assert r.status_code == 416, r.text
    assert httpx.get(url + "/v1/jobs").json() == ["big"]


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"seed": 2**64 - 1}, 201, ""),  # any 64-bit seed
        ({"seed": 2**64}, 422, "seed"),
        ({"seed": True}, 422, "seed"),
        ({"dp": True}, 422, "dp"),
        ({"dp": 2.0}, 422, "dp"),
        ({"max_steps": 2**53 + 1}, 422, "max_steps"),
        ({"name": "x" * 129}, 422, "name"),
        ({"batch": 8}, 422, "batch"),  # a misspelt field is named, not ignored
    ],
)
def test_job_fields_are_strict_and_bounded_as_documented(
    shared_dataserver: Proc, job: str, body: dict[str, Any], status: int, needle: str
) -> None:
    ds = shared_dataserver
    r = httpx.post(ds.url + "/v1/jobs", json={**JOB, "name": job, **body}, headers=AUTH)
    assert r.status_code == status and needle in r.text, r.text
    if status == 201:
        assert r.json()["seed"] == body["seed"]
        assert _fetch(ds, 0, 0).status_code == 404  # (j1 was never created)
        one = httpx.get(f"{ds.url}/v1/jobs/{job}/batches", params={"dp_rank": 1, "start": 3}, headers=AUTH)
        assert one.status_code == 200
    else:
        assert job not in httpx.get(ds.url + "/v1/jobs").json()  # nothing written (the list of job names)


@pytest.mark.parametrize(
    "extra",
    [
        {"udp": {"session": "0" * 16, "counter": 0, "inv_version": False}},
        {"budget_bytes": True},
        {"workers": [{"pid": 1}] * 4097},
        {"inventory": {f"j{i}": {} for i in range(1025)}},
        {"inventory": [1]},
    ],
)
def test_heartbeats_are_strict_and_bounded(shared_dataserver: Proc, job: str, extra: dict[str, Any]) -> None:
    r = _beat(shared_dataserver.url, job, _address_of(job), **extra)
    assert r.status_code == 422, r.text
    assert job not in _members(shared_dataserver)


@pytest.mark.parametrize(
    ("extra", "record"),
    [
        ({"exited": [{"pid": "1"}]}, "exited[0]"),
        ({"inventory": {"j": {"r": [{"step": "4"}]}}}, "inventory.j.r[0]"),
        ({"inventory": {"j": {"r": [{"step": 2**53}]}}}, "inventory.j.r[0]"),
        ({"inventory": {"j": {"r/x": [{"step": 1}]}}}, "inventory.j.r/x"),
    ],
)
def test_a_heartbeats_bad_record_is_dropped_and_named_not_the_node(
    shared_dataserver: Proc, job: str, extra: dict[str, Any], record: str
) -> None:
    r = _beat(shared_dataserver.url, job, _address_of(job), **extra)
    assert r.status_code == 200 and [d["record"] for d in r.json()["dropped"]] == [record], r.text
    assert job in _members(shared_dataserver)


# ---- 7. token and size before the body; members that go silent ------------------------------------


def _raw(url: str, head: str, body: bytes = b"") -> bytes:
    """Send a request head (and maybe the start of a body) and read the answer, the rest of the
    declared body unsent: a server that waits for the body before answering never answers."""
    host, port = url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=20) as s:
        s.sendall(head.encode() + body)
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
    return answer


def test_a_body_without_the_token_is_refused_before_it_is_read(dataserver: Proc) -> None:
    head = f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {300 << 20}\r\n\r\n"
    answer = _raw(dataserver.url, head, b'{"name": "')
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert b"bearer token" in answer or b"\r\n\r\n" in answer
    assert httpx.get(dataserver.url + "/v1/jobs").json() == []


def test_a_declared_oversize_body_is_refused_before_it_is_read(dataserver: Proc) -> None:
    head = f"POST /v1/nodes/heartbeat HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\nContent-Length: {17 << 20}\r\n\r\n"
    answer = _raw(dataserver.url, head, b'{"node_id": "')
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


def test_a_chunked_body_is_counted_as_it_arrives(dataserver: Proc) -> None:
    worker = json.dumps({"pid": 1, "job": "x" * 100}).encode()
    count = (17 << 20) // len(worker)

    def body() -> Iterator[bytes]:  # no Content-Length: sent chunked
        yield b'{"node_id": "big", "address": "http://127.0.0.1:9", "budget_bytes": 1, "workers": ['
        for i in range(count):
            yield worker + (b"," if i < count - 1 else b"")
        yield b"]}"

    try:
        r = httpx.post(
            dataserver.url + "/v1/nodes/heartbeat", content=body(), headers={**AUTH, "Content-Type": "application/json"}, timeout=60
        )
        status = r.status_code
    except httpx.HTTPError:  # the server may close the connection while we are still sending
        status = 413
    assert status == 413
    assert "big" not in _members(dataserver)
    assert httpx.get(dataserver.url + "/v1/jobs/x/status").json()["members"] == {}


def test_a_member_that_goes_silent_is_declared_dead_then_forgotten(serve: Callable[..., Proc]) -> None:
    ds = serve("--dead-after-s", "0.3", "--forget-dead-after-s", "1")
    inventory = {"j1": {"dp0-pp0-tp0": [{"step": 7, "checksum": "0" * 16, "nbytes": 1, "layout_roles": ["dp0-pp0-tp0", "dp1-pp0-tp0"]}]}}
    assert (
        _beat(ds.url, "fake", "http://10.9.9.9:1", inventory=inventory, workers=[{"pid": 1, "job": "j1", "dp_rank": 0}]).status_code == 200
    )
    until(lambda: httpx.get(ds.url + "/v1/nodes/fake").json().get("alive") is False, what="fake declared dead")
    assert httpx.get(ds.url + "/v1/nodes").json()["ring"] == []
    until(lambda: httpx.get(ds.url + "/v1/nodes/fake").status_code == 404, what="fake forgotten")
    status = httpx.get(ds.url + "/v1/jobs/j1/status").json()
    assert status["members"] == {} and status["roles"] == [] and status["dead"] == []
    assert httpx.get(ds.url + "/v1/nodes/view").json()["dead"] == []


# ---- 8. jobs and requests too big to serve ----------------------------------------------------------


def test_a_job_asking_for_too_many_samples_per_step_is_refused(dataserver: Proc) -> None:
    r = httpx.post(dataserver.url + "/v1/jobs", json={**JOB, "dp": 2**20, "batch_per_rank": 2**20}, headers=AUTH)
    assert r.status_code == 422 and "samples per step" in r.json()["detail"] and "--max-samples-per-step" in r.json()["detail"], r.text
    assert httpx.get(dataserver.url + "/v1/jobs").json() == []


def test_a_request_over_the_byte_limit_gets_413_naming_a_count_that_fits(serve: Callable[..., Proc]) -> None:
    ds = serve("--max-bytes-per-request", str(64 << 10))
    r = httpx.post(ds.url + "/v1/jobs", json={**JOB, "batch_per_rank": 4096}, headers=AUTH)
    assert r.status_code == 422 and "lower batch_per_rank" in r.json()["detail"], r.text  # one step would not fit
    assert httpx.post(ds.url + "/v1/jobs", json={**JOB, "batch_per_rank": 128}, headers=AUTH).status_code == 201
    r = _fetch(ds, 0, 0, 64)
    assert r.status_code == 413 and "ask for count=" in r.json()["detail"], r.text
    fits = int(r.json()["detail"].split("count=")[1].split()[0])
    assert 1 <= fits < 64 and _fetch(ds, 0, 0, fits).status_code == 200
    assert httpx.get(ds.url + "/v1/jobs/j1").json()["served_step"] == fits - 1  # the refused request served nothing


def test_big_bodies_are_streamed_and_small_ones_sent_whole(dataserver: Proc) -> None:
    # 300-sample dataset, 250,000 samples per rank and step: ~20 MB steps, too big to gather on
    # the event loop or to materialise as one body: streamed, each gathered on the encoder thread
    body = {**JOB, "dp": 1, "batch_per_rank": 250_000}
    assert httpx.post(dataserver.url + "/v1/jobs", json=body, headers=AUTH).status_code == 201
    assert httpx.post(dataserver.url + "/v1/jobs", json={**JOB, "name": "small"}, headers=AUTH).status_code == 201
    small = httpx.get(f"{dataserver.url}/v1/jobs/small/batches", params={"dp_rank": 0, "start": 0, "count": 4}, headers=AUTH)
    assert small.status_code == 200 and small.headers["content-length"] == str(len(small.content))
    # a daemon's run of small steps (--fetch-steps 16): one body too, not a chunk per step
    run = httpx.get(f"{dataserver.url}/v1/jobs/small/batches", params={"dp_rank": 0, "start": 4, "count": 16}, headers=AUTH)
    assert run.status_code == 200 and run.headers["content-length"] == str(len(run.content))
    steps = pa.ipc.open_stream(run.content)
    assert [steps.read_next_batch_with_custom_metadata().custom_metadata[b"step"] for _ in range(16)] == [
        str(s).encode() for s in range(4, 20)
    ]
    planner = Planner(300, 5, [Generation(0, 1, 250_000)])
    with httpx.stream(
        "GET", f"{dataserver.url}/v1/jobs/j1/batches", params={"dp_rank": 0, "start": 0, "count": 3}, headers=AUTH, timeout=120
    ) as r:
        assert r.status_code == 200 and "content-length" not in r.headers and r.headers.get("transfer-encoding") == "chunked"
        assert httpx.get(dataserver.url + "/v1/health").json() == {"status": "ok"}  # answered mid-stream
        data = r.read()
    reader = pa.ipc.open_stream(data)
    for step in (0, 1, 2):
        b = reader.read_next_batch_with_custom_metadata()
        assert b.custom_metadata[b"step"] == str(step).encode()
        assert b.batch.column(SAMPLE_INDEX_COLUMN).to_numpy().tolist() == planner.plan(0, step).indices.tolist()


# ---- 10. records that cannot be loaded ---------------------------------------------------------------


def test_a_torn_or_orphaned_job_record_breaks_only_its_job(serve: Callable[..., Proc], tmp_path: Path) -> None:
    ds = serve()
    assert httpx.post(ds.url + "/v1/jobs", json=JOB, headers=AUTH).status_code == 201
    ds.stop()
    state = tmp_path / "state"
    (state / "torn.json").write_text('{"name": "torn", "dataset": "tok')
    gone = {**json.loads((state / "j1.json").read_text()), "name": "gone", "dataset": "removed"}
    (state / "gone.json").write_text(json.dumps(gone))
    ds = serve()  # before: "Application startup failed", rc 3, for every job
    assert httpx.get(ds.url + "/v1/jobs").json() == ["gone", "j1", "torn"]
    assert _fetch(ds, 0, 0).status_code == 200  # the good job is served
    torn = httpx.get(ds.url + "/v1/jobs/torn").json()
    assert "torn.json" in torn["broken"] and "not a JSON job record" in torn["broken"]
    gone_view = httpx.get(ds.url + "/v1/jobs/gone").json()
    assert "unknown dataset 'removed'" in gone_view["broken"] and gone_view["max_steps"] == 100
    for path, params in (("torn/batches", {"dp_rank": 0, "start": 0}), ("gone/plan", {"dp_rank": 0, "step": 0})):
        r = httpx.get(f"{ds.url}/v1/jobs/{path}", params=params, headers=AUTH)
        assert r.status_code == 409 and "is broken" in r.json()["detail"] and "restart the data server" in r.json()["detail"], r.text
    r = httpx.post(ds.url + "/v1/jobs", json={**JOB, "name": "torn"}, headers=AUTH)
    assert r.status_code == 409 and "is broken" in r.json()["detail"]
    warnings = [json.loads(line) for line in ds.log_path.read_text().splitlines() if "job record unusable" in line]
    assert sorted(w["job"] for w in warnings) == ["gone", "torn"] and all(w["level"] == "warning" and w["reason"] for w in warnings)
