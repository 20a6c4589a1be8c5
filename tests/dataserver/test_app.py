from __future__ import annotations

import httpx
import numpy as np
import pyarrow as pa
import pytest

from dataserver import Generation, Planner
from dataserver.catalog import SAMPLE_INDEX_COLUMN
from tests._servers import TOKEN, Proc

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _create(ds: Proc, **overrides: object) -> httpx.Response:
    body = {"name": "j1", "dataset": "tokens", "dp": 2, "batch_per_rank": 8, "seed": 5, "max_steps": 100}
    body.update(overrides)
    return httpx.post(ds.url + "/v1/jobs", json=body, headers=AUTH)


def _batches(ds: Proc, job: str, dp_rank: int, start: int, count: int) -> list[pa.RecordBatch]:
    r = httpx.get(f"{ds.url}/v1/jobs/{job}/batches", params={"dp_rank": dp_rank, "start": start, "count": count}, headers=AUTH)
    assert r.status_code == 200, r.text
    reader = pa.ipc.open_stream(r.content)
    out = []
    for i in range(count):
        b = reader.read_next_batch_with_custom_metadata()
        assert b.custom_metadata[b"step"] == str(start + i).encode()
        out.append(b.batch)
    return out


def test_stream_matches_the_plan_and_the_dataset(dataserver: Proc) -> None:
    assert _create(dataserver).status_code == 201
    assert _create(dataserver).status_code == 200  # idempotent re-create
    planner = Planner(300, 5, [Generation(0, 2, 8)])
    for rank in range(2):
        for i, batch in enumerate(_batches(dataserver, "j1", rank, 3, 4)):
            idx = planner.plan(rank, 3 + i).indices
            assert batch.column(SAMPLE_INDEX_COLUMN).to_pylist() == idx.tolist()
            tokens = batch.column("tokens").values.to_numpy().reshape(-1, 16)
            assert np.array_equal(tokens[:, 0], idx)  # token 0 of row i is i (see conftest)


def test_variable_length_binary_dataset_streams(dataserver: Proc) -> None:
    assert _create(dataserver, name="img", dataset="images", dp=1, batch_per_rank=50).status_code == 201
    (batch,) = _batches(dataserver, "img", 0, 0, 1)
    for blob, idx in zip(batch.column("image").to_pylist(), batch.column(SAMPLE_INDEX_COLUMN).to_pylist()):
        assert int.from_bytes(blob[:4], "little") == idx
    assert batch.column("label").to_pylist() == [i % 10 for i in batch.column(SAMPLE_INDEX_COLUMN).to_pylist()]


def test_elastic_generation_over_http_and_persisted_across_restart(dataserver: Proc, tmp_path: object) -> None:
    assert _create(dataserver).status_code == 201
    r = httpx.post(dataserver.url + "/v1/jobs/j1/generations", json={"start_step": 10, "dp": 3, "batch_per_rank": 8}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert [g["dp"] for g in r.json()["generations"]] == [2, 3]
    (b,) = _batches(dataserver, "j1", 2, 10, 1)
    expected = Planner(300, 5, [Generation(0, 2, 8), Generation(10, 3, 8)]).plan(2, 10).indices
    assert b.column(SAMPLE_INDEX_COLUMN).to_pylist() == expected.tolist()
    conflict = httpx.post(dataserver.url + "/v1/jobs/j1/generations", json={"start_step": 5, "dp": 1, "batch_per_rank": 8}, headers=AUTH)
    assert conflict.status_code == 409 and "must start after step 10" in conflict.json()["detail"]


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status", "needle"),
    [
        ("post", "/v1/jobs", {"json": {"name": "x", "dataset": "nope", "dp": 1, "batch_per_rank": 1}}, 404, "unknown dataset 'nope'"),
        ("post", "/v1/jobs", {"json": {"name": "x", "dataset": "tokens", "dp": 0, "batch_per_rank": 1}}, 422, "dp"),
        ("post", "/v1/jobs", {"json": {"name": "../x", "dataset": "tokens", "dp": 1, "batch_per_rank": 1}}, 422, "must match"),
        ("get", "/v1/jobs/ghost/batches", {"params": {"dp_rank": 0, "start": 0}}, 404, "unknown job 'ghost'"),
        ("get", "/v1/jobs/j1/batches", {"params": {"dp_rank": 0, "start": 100}}, 416, "step 100 is outside job 'j1'"),
        ("get", "/v1/jobs/j1/batches", {"params": {"dp_rank": 2, "start": 0}}, 416, "dp_rank 2 out of range"),
        ("get", "/v1/jobs/j1/batches", {"params": {"dp_rank": 0, "start": 0, "count": 10_000}}, 413, "exceeds the limit"),
        ("get", "/v1/jobs/j1/batches", {"params": {"dp_rank": 0, "start": -1}}, 422, "start"),
    ],
)
def test_bad_requests_get_clear_4xx(dataserver: Proc, method: str, path: str, kwargs: dict[str, object], status: int, needle: str) -> None:
    assert _create(dataserver).status_code == 201
    r = getattr(httpx, method)(dataserver.url + path, headers=AUTH, **kwargs)
    assert r.status_code == status, r.text
    assert needle in r.text
    assert httpx.get(dataserver.url + "/v1/jobs").json() == ["j1"]  # nothing else was created


def test_token_required_for_creation_and_streaming(dataserver: Proc) -> None:
    body = {"name": "j1", "dataset": "tokens", "dp": 1, "batch_per_rank": 1}
    assert httpx.post(dataserver.url + "/v1/jobs", json=body).status_code == 401
    assert httpx.post(dataserver.url + "/v1/jobs", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(dataserver.url + "/v1/jobs").json() == []
    assert _create(dataserver).status_code == 201
    r = httpx.get(dataserver.url + "/v1/jobs/j1/batches", params={"dp_rank": 0, "start": 0})
    assert r.status_code == 401 and "bearer token" in r.text


def test_openapi_and_metrics_published(dataserver: Proc) -> None:
    paths = httpx.get(dataserver.url + "/openapi.json").json()["paths"]
    assert {"/v1/jobs", "/v1/jobs/{name}/batches", "/v1/datasets"} <= set(paths)
    assert _create(dataserver).status_code == 201
    _batches(dataserver, "j1", 0, 0, 3)
    text = httpx.get(dataserver.url + "/metrics").text
    assert 'ffplane_dataserver_steps_served_total{job="j1"} 3.0' in text
