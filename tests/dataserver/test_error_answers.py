"""The data server's one error handler, in process (``create_app`` under FastAPI's TestClient):
each shared error answers with its class's status and the ``{"detail": message}`` body, a
NotCoordinatorError names the leader in its header, and real routes answer their errors so."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from dataserver.app import create_app
from dataserver.config import ServeConfig
from ffplane_contract import errors
from ffplane_contract.servers import LEADER_HEADER
from tests._servers import TOKEN

AUTH = {"Authorization": f"Bearer {TOKEN}"}
JOB = {"name": "j1", "dataset": "tokens", "dp": 2, "batch_per_rank": 8, "seed": 5, "max_steps": 100}


@pytest.fixture
def app(data_dir: Path) -> FastAPI:
    app = create_app(ServeConfig(data_dir=data_dir, port=0, heartbeat_udp_port=-1), TOKEN)

    async def planted(kind: str) -> None:  # raises the error a route would, by its kind
        raise errors._KINDS[kind](f"a planted {kind}")

    app.add_api_route("/planted/{kind}", planted)
    return app


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as client:  # runs the lifespan: the jobs are loaded, the loops run
        yield client


@pytest.mark.parametrize("cls", sorted(errors._KINDS.values(), key=lambda c: c.__name__))
def test_each_shared_error_answers_its_class_status_and_the_detail_body(client: TestClient, cls: type[errors.FFPlaneError]) -> None:
    r = client.get(f"/planted/{cls.__name__}")
    assert r.status_code == cls.status, r.text
    assert r.json() == {"detail": f"a planted {cls.__name__}"}


def test_routes_answer_not_found_conflict_and_past_the_end(client: TestClient) -> None:
    r = client.get("/v1/jobs/ghost")
    assert r.status_code == 404 and r.json() == {"detail": "unknown job 'ghost'; create it with POST /v1/jobs"}
    assert client.post("/v1/jobs", json=JOB, headers=AUTH).status_code == 201
    r = client.post("/v1/jobs", json={**JOB, "seed": 6}, headers=AUTH)
    assert r.status_code == 409 and r.json() == {"detail": "job 'j1' exists with a different definition; pick another name"}
    r = client.get("/v1/jobs/j1/plan", params={"dp_rank": 0, "step": 100})
    assert r.status_code == 416 and "step 100 is outside job 'j1'" in r.json()["detail"]
    r = client.get("/v1/datasets/nope")
    assert r.status_code == 404 and r.json()["detail"].startswith("unknown dataset 'nope'")


def test_a_follower_answers_421_naming_the_leader(app: FastAPI, client: TestClient) -> None:
    coordination = app.state.server.coordination
    assert client.get("/v1/nodes").status_code == 200
    coordination.leading = False  # as after losing the lead (no etcd here: no leader is known)
    r = client.get("/v1/nodes")
    assert r.status_code == 421 and r.headers[LEADER_HEADER] == coordination.url
    assert set(r.json()) == {"detail"} and "does not coordinate" in r.json()["detail"]


def test_a_body_that_is_not_json_is_415_and_a_schema_violation_422(client: TestClient) -> None:
    r = client.post("/v1/jobs", content=b"name=j1", headers={**AUTH, "Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415 and "application/json" in r.json()["detail"]
    r = client.post("/v1/jobs", json={**JOB, "dp": True}, headers=AUTH)
    assert r.status_code == 422 and set(r.json()) == {"detail"} and "dp" in r.json()["detail"]
