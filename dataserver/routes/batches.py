"""The batch path: a rank's plan for a step, and the batches of a run of steps as one Arrow IPC
stream, recorded served before any byte leaves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Response
from fastapi.responses import StreamingResponse

from dataserver.dataset import Dataset, DatasetError
from dataserver.http_errors import PAST_THE_END, TOO_LARGE, documented
from dataserver.jobs import Job
from dataserver.planner import Generation, Planner
from dataserver.routes._common import SECURED, TOKEN, Count, DpRank, PathName, Server, Step
from dataserver.server_state import DataServer
from dataserver.stream import MEDIA_TYPE, StepEncoder, WholeBody, encode_steps
from ffplane_contract.errors import (
    CapacityError,
    ConflictError,
    InvalidError,
    NotFoundError,
    UnauthorisedError,
    UnavailableError,
)

router = APIRouter()

_WHOLE_BODY_STEPS = 4
_WHOLE_RUN_BYTES = 4 << 20  # a run of small steps (a daemon's prefetch) is one body up to this size, whatever its count
# The whole-body path materialises the response; above this (estimated) size it streams instead.
_WHOLE_BODY_BYTES = 64 << 20
# A step estimated above this is encoded on a worker thread, so the event loop (health checks,
# heartbeats) keeps answering while it is gathered; smaller steps are encoded on the loop, which
# measured faster for the usual ~4 MiB steps (docs/decisions.md, "Data path, fourth pass").
_INLINE_STEP_BYTES = 16 << 20
_ADMIT_ATTEMPTS = 4  # a request re-checked this often when other servers keep changing its job's plan


def _generation(job: Job, dp_rank: int, step: int, planner: Planner | None = None) -> Generation:
    """The generation ``step`` of ``job`` is planned in; NotFoundError (416) if the step or
    ``dp_rank`` lies outside the job."""
    try:
        job.check_step(step)
        gen, _ = (planner or job.planner).generation_at(step)
    except ValueError as exc:
        raise NotFoundError(str(exc), PAST_THE_END) from exc
    if dp_rank >= gen.dp:
        raise NotFoundError(f"dp_rank {dp_rank} out of range: step {step} has dp={gen.dp}", PAST_THE_END)
    return gen


@router.get("/v1/jobs/{name}/plan", responses=documented(NotFoundError, ConflictError, (NotFoundError, PAST_THE_END), InvalidError))
def get_plan(name: PathName, dp_rank: DpRank, step: Step, server: Server) -> dict[str, Any]:
    jobs = server.jobs
    jobs.refresh(name)  # other data servers may have changed it
    job = jobs.get(name)
    _generation(job, dp_rank, step)
    plan = job.planner.plan(dp_rank, step)
    return {"step": step, "dp_rank": dp_rank, "epoch": plan.epoch, "indices": plan.indices.tolist()}


@router.get(
    "/v1/jobs/{name}/batches",
    response_class=StreamingResponse,
    responses={
        200: {"content": {MEDIA_TYPE: {}}},
        **documented(
            UnauthorisedError,
            NotFoundError,
            ConflictError,
            (CapacityError, TOO_LARGE),
            (NotFoundError, PAST_THE_END),
            InvalidError,
            UnavailableError,
        ),
    },
    dependencies=TOKEN,
    openapi_extra=SECURED,
)
async def stream_batches(name: PathName, dp_rank: DpRank, start: Step, server: Server, count: Count = 1) -> Response:
    """The batches of ``dp_rank`` for steps ``start .. start+count-1`` as one Arrow IPC stream."""
    job = await server.job(name)
    limit = server.config.max_steps_per_request
    if count > limit:
        raise CapacityError(f"count={count} exceeds the limit of {limit} steps per request", TOO_LARGE)
    steps = range(start, start + count)
    dataset, sample_bytes = await _open(server, job)
    planner, step_bytes = await _admit(server, job, dp_rank, steps, sample_bytes)
    return _respond(server, name, dataset, planner, dp_rank, steps, step_bytes)


async def _open(server: DataServer, job: Job) -> tuple[Dataset, int]:
    """``job``'s dataset, opened, and its bytes per sample (a job's dataset is fixed: plans change, not it)."""
    catalog, name = server.catalog, job.spec.dataset
    dataset, sample_bytes = catalog.opened(name), catalog.known_sample_bytes(name)
    if dataset is not None and sample_bytes is not None:
        return dataset, sample_bytes
    loop = asyncio.get_running_loop()
    try:
        dataset = await loop.run_in_executor(server.opener, catalog.get, name)
        sample_bytes = await loop.run_in_executor(server.opener, catalog.sample_bytes, name)
    except NotFoundError as exc:
        raise ConflictError(f"job {job.spec.name!r}'s dataset is gone: {exc}") from exc
    except (DatasetError, OSError) as exc:
        raise UnavailableError(f"job {job.spec.name!r}'s dataset cannot be read: {exc}") from exc
    return dataset, sample_bytes


async def _admit(server: DataServer, job: Job, dp_rank: int, steps: range, sample_bytes: int) -> tuple[Planner, list[int]]:
    """Check the request against ``job``'s plan and record its steps served: the planner it was
    checked with and each step's estimated bytes. Checked again when another data server changed
    the plan meanwhile."""
    name, limit = job.spec.name, server.config.max_bytes_per_request
    for _ in range(_ADMIT_ATTEMPTS):
        planner = job.planner
        step_bytes = [_generation(job, dp_rank, step, planner).batch_per_rank * sample_bytes for step in steps]
        total = sum(step_bytes)
        if total > limit:
            fit = max(1, limit // max(step_bytes))
            raise CapacityError(
                f"{len(steps)} steps of ~{max(step_bytes)} bytes each would be ~{total} bytes, over the limit of "
                f"{limit} bytes per request; ask for count={fit} or fewer",
                TOO_LARGE,
            )
        try:
            if await server.jobs.admit(job, steps[-1], planner):  # recorded served before any byte leaves
                return planner, step_bytes
        except (OSError, ConflictError) as exc:
            raise UnavailableError(f"cannot record the served step of job {name!r}: {exc}") from exc
        job = server.jobs.get(name)  # another data server changed the job's plan: check the request again
    raise UnavailableError(f"job {name!r}'s plan kept changing under this request; ask again")


def _respond(
    server: DataServer, name: str, dataset: Dataset, planner: Planner, dp_rank: int, steps: range, step_bytes: list[int]
) -> Response:
    metrics, count, total = server.metrics, len(steps), sum(step_bytes)
    headers = {"X-FFplane-Steps": f"{steps[0]}-{steps[-1]}"}
    few = count <= _WHOLE_BODY_STEPS or total <= _WHOLE_RUN_BYTES
    if few and total <= _WHOLE_BODY_BYTES and max(step_bytes) <= _INLINE_STEP_BYTES:
        # Few small steps, or a daemon's run of tiny ones: one body with a Content-Length,
        # encoded here on the loop. Chunked streaming costs a chunk header per piece and an ASGI
        # send per step (a 16-step run of 2 KiB steps: 0.21 → 0.15 ms of the server's CPU a
        # step, bench/path_cpu.py), and measured ~2x slower for single 4 MiB steps.
        parts = list(encode_steps(dataset, planner, dp_rank, steps))
        whole = WholeBody(parts, MEDIA_TYPE, headers)
        metrics.bytes.labels(name).inc(whole.nbytes)
        metrics.steps.labels(name).inc(count)
        return whole

    encoder = StepEncoder(dataset, planner, dp_rank)
    loop = asyncio.get_running_loop()

    async def body() -> AsyncIterator[bytes | memoryview]:
        for step, nbytes in zip(steps, step_bytes):
            if nbytes > _INLINE_STEP_BYTES:
                parts = await loop.run_in_executor(server.big_steps, encoder.step, step)
            else:
                parts = encoder.step(step)
            for chunk in parts:
                metrics.bytes.labels(name).inc(len(chunk))
                yield chunk  # the loop sends it before the next step is encoded
        for chunk in encoder.close():
            yield chunk
        metrics.steps.labels(name).inc(count)

    return StreamingResponse(body(), media_type=MEDIA_TYPE, headers=headers)
