"""Schemathesis over a live daemon's OpenAPI spec (issue #15): no 5xx, every status code, media
type, header and body as documented, schema-invalid input refused, with and without the token.

One data server and one daemon serve the module: a job whose batches are cached and whose state
is saved, so that besides random paths every operation is also tried on a shard the daemon
holds. The run is bounded (``EXAMPLES`` per operation and mode, no shrinking) and derandomised:
the same requests every run, so a failure in CI reproduces locally.

Driven through ``APIOperation.as_strategy`` rather than ``schemathesis.pytest.from_fixture``:
that loader reads ``request.node._nodeid``, which pytest 9 no longer has.
"""

from __future__ import annotations

import shutil
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import hypothesis
import pytest
import schemathesis
import torch
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode, Response, checks
from schemathesis.core.failures import FailureGroup
from schemathesis.core.result import Ok
from schemathesis.schemas import APIOperation

from dataserver.ingest import IngestConfig, ingest
from tests._servers import TOKEN, Proc, start
from tests.conftest import create_job, write_token_parquet
from trainer_client import Checkpointer, DataLoader

AUTH = {"Authorization": f"Bearer {TOKEN}"}
EXAMPLES = 40
KNOWN = {"job": "job", "role": "dp0-pp0-tp0", "step": 2}  # a shard the daemon holds


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    work = tmp_path_factory.mktemp("fuzz")
    (work / "datasets").mkdir()
    write_token_parquet(work / "tokens.parquet", 64)
    ingest(IngestConfig([work / "tokens.parquet"], work / "datasets" / "tokens", progress=False))
    root = Path("/dev/shm") / f"ffplane-test-{uuid.uuid4().hex[:8]}"
    procs: list[Proc] = []
    try:
        ds = start(
            "dataserver",
            ["serve", "--data-dir", str(work / "datasets"), "--port", "0"],
            work,
            "dataserver",
        )
        procs.append(ds)
        args = [
            "serve",
            "--dataserver",
            ds.url,
            "--root",
            str(root),
            "--port",
            "0",
            "--budget-mb",
            "64",
            "--node-id",
            "fuzz",
        ]
        procs.append(start("statestore", args, work, "daemon"))
        create_job(ds, name="job", dp=1, max_steps=8)
        sock = root / "daemon.sock"
        assert (
            len(
                list(
                    DataLoader(
                        "job",
                        0,
                        dataserver=ds.url,
                        token=TOKEN,
                        socket_path=sock,
                        end_step=2,
                    )
                )
            )
            == 2
        )
        ck = Checkpointer("job", socket_path=sock)
        for step in range(3):
            ck.save(step, {"w": torch.arange(1000.0) + step, "step": step})
        ck.close()
        yield procs[-1]
    finally:
        for p in reversed(procs):
            p.kill()
        shutil.rmtree(root, ignore_errors=True)


def no_server_error(ctx: object, response: Response, case: Case) -> None:
    """No 5xx at all (a full --budget-mb, e.g. of transfers the fuzzer began and left, is a 413)."""
    if response.status_code >= 500:
        raise AssertionError(f"{response.status_code} for {case.method} {case.formatted_path}: {response.text[:500]}")


CHECKS = [
    no_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_headers_conformance,
    checks.response_schema_conformance,
    checks.negative_data_rejection,
]
SETTINGS = hypothesis.settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(hypothesis.HealthCheck),
    phases=[
        hypothesis.Phase.explicit,
        hypothesis.Phase.generate,
    ],  # report, do not minimise
)


def _runner(
    op: APIOperation,
    path_parameters: dict[str, object] | None,
    headers: dict[str, str],
    seen: Counter[tuple[str, int]],
) -> Callable[[], None]:
    """A Hypothesis test of ``op`` with positive and negative data; counts the answers in ``seen``."""
    label = op.label if path_parameters is None else f"{op.label} (held)"
    modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)

    @hypothesis.given(case=st.one_of(*(op.as_strategy(mode, path_parameters=path_parameters) for mode in modes)))
    @SETTINGS
    def run(case: Case) -> None:
        response = case.call_and_validate(headers=headers, checks=CHECKS)
        seen[(label, response.status_code)] += 1

    return run


def _fuzz(url: str, headers: dict[str, str]) -> tuple[list[str], Counter[tuple[str, int]]]:
    """Every operation of the spec at ``url``, and again with the path naming a shard the daemon
    holds. Returns one entry per failing operation, and how often each (operation, status) was
    answered."""
    schema = schemathesis.openapi.from_url(url)
    failures: list[str] = []
    seen: Counter[tuple[str, int]] = Counter()
    for result in schema.get_all_operations():
        if not isinstance(result, Ok):
            failures.append(f"the spec is invalid: {result.err()}")
            continue
        op = result.ok()
        names = {p.name for p in op.path_parameters}
        variants: list[dict[str, object] | None] = [None]
        if names and names <= KNOWN.keys():
            variants.append({k: v for k, v in KNOWN.items() if k in names})
        for path_parameters in variants:
            try:
                _runner(op, path_parameters, headers, seen)()
            except (
                AssertionError,
                OSError,
                FailureGroup,
            ) as exc:  # collected: one run reports every operation
                failures.append(f"{op.label} {path_parameters or ''}:\n{exc}")
    return failures, seen


@pytest.mark.parametrize("token", [True, False], ids=["with-token", "without-token"])
def test_daemon_api_answers_as_documented(daemon: Proc, token: bool) -> None:
    failures, seen = _fuzz(daemon.url + "/openapi.json", AUTH if token else {})
    assert not failures, "\n\n".join(failures)
    shard_reads = {status for (label, status), _ in seen.items() if label == "GET /v1/state/{job}/{role}/{step}/shard (held)"}
    assert (200 in shard_reads) == token and (401 in shard_reads) == (not token), seen  # the fuzzer got in, or was kept out
    assert httpx.get(daemon.url + "/v1/health").json() == {"status": "ok"}
