"""Jobs: created over a dataset with a seed and a layout, changed by new generations (an elastic
change of layout from a step on), read back as ``JobView``, deleted."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Response

from dataserver.catalog import Catalog
from dataserver.dataset import DatasetError
from dataserver.http_errors import NOT_JSON, TOO_LARGE, documented
from dataserver.jobs import BrokenJob, Job, JobSpec
from dataserver.planner import Generation
from dataserver.routes._common import LEADER_ONLY, SECURED, TOKEN, PathName, Server
from ffplane_contract.dataserver_http import GenerationCreate, GenerationView, JobCreate, JobView
from ffplane_contract.errors import (
    CapacityError,
    ConflictError,
    FFPlaneError,
    InvalidError,
    NotCoordinatorError,
    NotFoundError,
    UnauthorisedError,
    UnavailableError,
)

log = logging.getLogger(__name__)
router = APIRouter()


def job_view(job: Job, catalog: Catalog) -> JobView:
    spec = job.spec
    return JobView(
        name=spec.name,
        dataset=catalog.describe(spec.dataset),
        seed=spec.seed,
        max_steps=spec.max_steps,
        generations=[GenerationView(start_step=g.start_step, dp=g.dp, batch_per_rank=g.batch_per_rank) for g in spec.generations],
        served_step=job.served_step,
    )


def _broken_view(broken: BrokenJob) -> JobView:
    spec = broken.spec
    return JobView(
        name=broken.name,
        dataset={"name": spec.dataset} if spec is not None else None,
        seed=spec.seed if spec is not None else None,
        max_steps=spec.max_steps if spec is not None else None,
        generations=[GenerationView(start_step=g.start_step, dp=g.dp, batch_per_rank=g.batch_per_rank) for g in spec.generations]
        if spec is not None
        else [],
        served_step=None,
        broken=broken.reason,
    )


@router.post(
    "/v1/jobs",
    status_code=201,
    dependencies=TOKEN,
    responses={
        200: {"model": JobView, "description": "the same job existed already"},
        **documented(UnauthorisedError, NotFoundError, ConflictError, (CapacityError, TOO_LARGE), InvalidError, (InvalidError, NOT_JSON)),
    },
    openapi_extra=SECURED,
)
def create_job(body: JobCreate, response: Response, server: Server) -> JobView:
    catalog = server.catalog
    dataset = catalog.get(body.dataset)
    server.check_layout(body.dp, body.batch_per_rank, catalog.sample_bytes(body.dataset))
    try:
        spec = JobSpec(**body.model_dump())
        job, created = server.jobs.create(spec, dataset.num_samples)
    except FFPlaneError:
        raise
    except ValueError as exc:  # the planner's own refusal (a dataset without samples)
        raise InvalidError(str(exc)) from exc
    if not created:
        response.status_code = 200
    log.info("job created" if created else "job exists", extra={"job": spec.name})
    return job_view(job, catalog)


@router.get("/v1/jobs")
def list_jobs(server: Server) -> list[str]:
    return server.jobs.names()


@router.get("/v1/jobs/{name}", responses=documented(NotFoundError, InvalidError))
def get_job(name: PathName, server: Server) -> JobView:
    jobs = server.jobs
    jobs.refresh(name)  # other data servers may have changed it
    broken = jobs.broken(name)
    if broken is not None:
        return _broken_view(broken)
    return job_view(jobs.get(name), server.catalog)


@router.delete(
    "/v1/jobs/{name}",
    status_code=204,
    dependencies=TOKEN,
    responses=documented(UnauthorisedError, NotFoundError, InvalidError),
    openapi_extra=SECURED,
)
def delete_job(name: PathName, server: Server) -> Response:
    """Forget the job's record and served steps; batches of it are no longer served. The
    node daemons keep its checkpoints (their /v1/state lists them) until their roots are wiped."""
    if not server.jobs.delete(name):
        raise NotFoundError(f"unknown job {name!r}")
    log.info("job deleted", extra={"job": name})
    return Response(status_code=204)


# Async: the committed step comes from the coordinator, which lives on the event loop.
@router.post(
    "/v1/jobs/{name}/generations",
    dependencies=[*TOKEN, *LEADER_ONLY],
    responses=documented(
        UnauthorisedError,
        NotFoundError,
        ConflictError,
        (CapacityError, TOO_LARGE),
        NotCoordinatorError,
        InvalidError,
        UnavailableError,
        (InvalidError, NOT_JSON),
    ),
    openapi_extra=SECURED,
)
async def add_generation(name: PathName, body: GenerationCreate, server: Server) -> JobView:
    job = await server.job(name)
    try:
        sample_bytes = await server.sample_bytes(job.spec.dataset)
    except NotFoundError as exc:
        raise ConflictError(f"job {name!r}'s dataset is gone: {exc}") from exc
    except (DatasetError, OSError) as exc:
        raise ConflictError(f"job {name!r}'s dataset cannot be read: {exc}") from exc
    server.check_layout(body.dp, body.batch_per_rank, sample_bytes)
    gen = Generation(body.start_step, body.dp, body.batch_per_rank)
    newest = server.coordination.coordinator.newest_step(name)
    job = await server.registry(server.jobs.add_generation, name, gen, newest, body.replan_served)
    log.info("new generation", extra={"job": name, **body.model_dump()})
    return job_view(job, server.catalog)
