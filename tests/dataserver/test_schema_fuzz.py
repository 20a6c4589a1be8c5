"""Schemathesis over the data server's own OpenAPI document, against a real server process.

Every operation gets a bounded number of generated requests (valid and schema-violating, and the
coverage phase's boundary values: the longest names, the largest integers, ``true`` for an
integer), once with the job's bearer token and once without. The checks: no 5xx, every status
code and content type one the document lists for that operation, every response body valid
against its documented schema, and schema-violating input refused with a 4xx. Half of the
generated job and dataset names are the real ones and some addresses realistic, so requests get
past "unknown job" into plans, batches, generations and registrations. Heartbeats and
generations change the test server's state; that is what a test server is for.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import events

from dataserver.ingest import IngestConfig, ingest
from tests._servers import TOKEN, Proc, start
from tests.conftest import write_token_parquet

AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_EXAMPLES = 40  # per operation and generation mode; both runs take ~30 s on 2 cores
CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("fuzz")
    root = tmp / "datasets"
    root.mkdir()
    write_token_parquet(tmp / "tokens.parquet", 300)
    ingest(IngestConfig([tmp / "tokens.parquet"], root / "tokens", shard_bytes=4096, progress=False))
    proc = start("dataserver", ["serve", "--data-dir", str(root), "--port", "0"], tmp, "dataserver")
    try:
        job = {"name": "j1", "dataset": "tokens", "dp": 2, "batch_per_rank": 8, "seed": 5, "max_steps": 100}
        assert httpx.post(proc.url + "/v1/jobs", json=job, headers=AUTH).status_code == 201
        yield proc
    finally:
        proc.stop()


def _fuzz(url: str, headers: dict[str, str] | None) -> tuple[list[str], dict[int, int]]:
    """Run schemathesis' phases over ``url``'s document: (failures, responses by status)."""
    config: dict[str, Any] = {
        "seed": 20261122,  # reproducible: a failure here fails the same way again
        "dictionaries": {
            "names": {"values": ["j1", "tokens"]},
            "addresses": {"values": ["http://127.0.0.1:9", "http://0.0.0.0:1", "http://10.0.0.1:8471", "http://[::1]:1"]},
        },
        "parameters": {
            "path.name": {"dictionary": "names", "probability": 0.6},
            "body.dataset": {"dictionary": "names", "probability": 0.6},
            "body.address": {"dictionary": "addresses", "probability": 0.5},
        },
        "generation": {"max-examples": MAX_EXAMPLES, "mode": "all"},
        "phases": {"stateful": {"enabled": False}},
        "checks": {"enabled": False, **{name: {"enabled": True} for name in CHECKS}},
    }
    if headers is not None:
        config["headers"] = headers
    schema = schemathesis.openapi.from_url(url + "/openapi.json", config=SchemathesisConfig.from_dict(config))
    failures: dict[tuple[str, str, str], str] = {}
    statuses: dict[int, int] = {}
    for event in schemathesis.engine.from_schema(schema).execute():
        if isinstance(event, events.FatalError):
            failures[("engine", "fatal", repr(event.exception))] = f"schemathesis stopped: {event.exception!r}"
        if isinstance(event, events.NonFatalError):  # e.g. a request the server did not answer
            failures[(event.label, "error", repr(event.value))] = f"{event.label}: {event.info.message}\n{event.value!r}"
        if not isinstance(event, events.ScenarioFinished):
            continue
        recorder = event.recorder
        for interaction in recorder.interactions.values():
            if interaction.response is not None:
                statuses[interaction.response.status_code] = statuses.get(interaction.response.status_code, 0) + 1
        for case_id, checks in recorder.checks.items():
            for check in checks:
                if check.failure_info is None:
                    continue
                failure = check.failure_info.failure
                key = (recorder.label, check.name, failure.title)
                if key not in failures:
                    node = recorder.cases.get(case_id)
                    curl = node.value.as_curl_command(headers=None) if node is not None else ""
                    failures[key] = f"{recorder.label} {check.name}: {failure.title}\n{failure.message}\n{curl}"
    return sorted(failures.values()), statuses


@pytest.mark.parametrize("token", [True, False], ids=["with-token", "without-token"])
def test_the_api_keeps_to_its_document(server: Proc, token: bool) -> None:
    failures, statuses = _fuzz(server.url, AUTH if token else None)
    assert not failures, "\n\n".join(failures)
    assert not any(s >= 500 for s in statuses), statuses
    if token:  # the run got past validation into the operations themselves
        assert statuses.get(200, 0) >= 50 and statuses.get(416, 0) and statuses.get(409, 0), statuses
    else:  # everything that takes a body or streams batches wanted the token
        assert statuses.get(401, 0) >= 4, statuses
    assert httpx.get(server.url + "/v1/health").json() == {"status": "ok"}


def test_every_operation_documents_its_errors(server: Proc) -> None:
    """The codes an operation really answers are in the document, each with a {detail} body."""
    spec = httpx.get(server.url + "/openapi.json").json()
    expected = {
        ("post", "/v1/jobs"): {"401", "404", "409", "413", "422"},
        ("post", "/v1/jobs/{name}/generations"): {"401", "404", "409", "413", "422"},
        ("get", "/v1/jobs/{name}/batches"): {"401", "404", "409", "413", "416", "422", "503"},
        ("get", "/v1/jobs/{name}/plan"): {"404", "409", "416", "422"},
        ("post", "/v1/nodes/heartbeat"): {"401", "409", "413", "422"},
        ("get", "/v1/jobs/{name}"): {"404", "422"},
        ("get", "/v1/datasets/{name}"): {"404", "422"},
        ("get", "/v1/nodes/{node_id}"): {"404", "422"},
    }
    for (method, path), codes in expected.items():
        responses = spec["paths"][path][method]["responses"]
        assert codes <= set(responses), (method, path, sorted(responses))
        for code in codes:
            assert responses[code]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorDetail"}, (path, code)
    assert spec["components"]["schemas"]["ErrorDetail"]["properties"]["detail"]["type"] == "string"
    job = spec["components"]["schemas"]["JobCreate"]["properties"]
    assert job["seed"].get("exclusiveMaximum") == 2**64  # any 64-bit seed: 0 .. 2**64 - 1
    assert job["name"]["maxLength"] == 128 and job["dataset"]["maxLength"] == 128
