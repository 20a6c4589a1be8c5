"""The data server's HTTP API (FastAPI): datasets, jobs, plans and the batch stream."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.responses import StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from pydantic import BaseModel, Field

from dataserver.catalog import Catalog, DatasetError
from dataserver.config import ServeConfig
from dataserver.coordinator import Coordinator, listen_udp
from dataserver.httpserver import BearerAuth, load_token
from dataserver.jobs import Job, JobConflict, JobError, JobRegistry, JobSpec
from dataserver.planner import Generation
from dataserver.stream import MEDIA_TYPE, WholeBody, encode_steps

log = logging.getLogger(__name__)
_WHOLE_BODY_STEPS = 4


class JobCreate(BaseModel):
    name: str = Field(min_length=1, max_length=128)
    dataset: str = Field(min_length=1, max_length=256)
    dp: int = Field(ge=1, le=1 << 20)
    batch_per_rank: int = Field(ge=1, le=1 << 20)
    seed: int = Field(default=0, ge=0, lt=1 << 63)
    max_steps: int | None = Field(default=None, ge=1)


class GenerationCreate(BaseModel):
    start_step: int = Field(ge=1)
    dp: int = Field(ge=1, le=1 << 20)
    batch_per_rank: int = Field(ge=1, le=1 << 20)


class UdpSession(BaseModel):
    session: str = Field(pattern=r"^[0-9a-f]{16}$")  # the daemon process's random UDP session id
    counter: int = Field(ge=0, lt=1 << 64)  # the highest message counter it has used
    inv_version: int = Field(ge=0, lt=1 << 64)  # the version of the inventory in this heartbeat


class Heartbeat(BaseModel):
    node_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
    address: str = Field(min_length=1, max_length=256)
    budget_bytes: int = Field(ge=0)
    inventory: dict[str, dict[str, list[dict[str, Any]]]] = Field(default_factory=dict)
    workers: list[dict[str, Any]] = Field(default_factory=list)
    exited: list[dict[str, Any]] = Field(default_factory=list)
    udp: UdpSession | None = None  # present when the daemon will send UDP beats


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.steps = Counter("ffplane_dataserver_steps_served", "Batches (one per TID) streamed", ["job"], registry=self.registry)
        self.bytes = Counter("ffplane_dataserver_bytes_served", "Arrow IPC bytes streamed", ["job"], registry=self.registry)


def _job_view(job: Job, catalog: Catalog) -> dict[str, Any]:
    spec = job.spec
    return {
        "name": spec.name,
        "dataset": catalog.get(spec.dataset).describe(),
        "seed": spec.seed,
        "max_steps": spec.max_steps,
        "generations": [
            {"start_step": g.start_step, "dp": g.dp, "batch_per_rank": g.batch_per_rank}
            for g in spec.generations
        ],
    }


def create_app(config: ServeConfig, token: str | None = None) -> FastAPI:
    """The data server app; ``token`` defaults to the configured token file or environment."""
    catalog = Catalog(config.data_dir)
    jobs = JobRegistry(config.resolved_state_dir())
    auth = BearerAuth(token if token is not None else load_token(config.token_file))
    metrics = _Metrics()
    coordinator = Coordinator(config.dead_after_s, auth.token)

    async def bounded(request: Request) -> None:  # async: no thread-pool hop per request
        size = int(request.headers.get("content-length") or 0)
        if size > config.max_body_bytes:
            raise HTTPException(413, f"request body of {size} bytes exceeds the limit of {config.max_body_bytes}")

    needs_token = [Depends(bounded), Depends(auth)]
    # Batches are encoded on the event loop, step by step (~0.5 ms per 4 MiB): with a thread
    # per concurrent request the GIL changed hands ~250 times per step (futex storm, 2.6 ms of
    # system time), and even one encoder thread's hand-offs cost more than they overlapped on
    # 2 cores (docs/decisions.md, "Data path, fourth pass"). Opening a dataset, which can take
    # seconds, still runs off the loop, on this one thread.
    opener = ThreadPoolExecutor(1, thread_name_prefix="open-dataset")

    async def sweep() -> None:
        due = time.monotonic()
        while True:
            # A sweep that runs late (the loop stalled) declares nobody dead: beats queued in the
            # socket during the stall are read first, and the next sweep judges.
            if time.monotonic() - due < config.sweep_s:
                coordinator.sweep()
            due = time.monotonic() + config.sweep_s
            await asyncio.sleep(config.sweep_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        names = jobs.load(lambda ds: catalog.get(ds).num_samples)
        log.info("dataserver ready", extra={"datasets": catalog.names(), "jobs": names})
        sweeper = asyncio.create_task(sweep(), name="coordinator sweep")
        udp = None
        if config.heartbeat_udp_port >= 0 and auth.token is not None:
            udp = await listen_udp(coordinator, config.host, config.heartbeat_udp_port)
        yield
        if udp is not None:
            udp.close()
        sweeper.cancel()
        opener.shutdown(wait=True, cancel_futures=True)
        catalog.close()

    app = FastAPI(title="ffplane dataserver", version="0.1.0", lifespan=lifespan)

    def job_or_404(name: str) -> Job:
        try:
            return jobs.get(name)
        except KeyError as exc:
            raise HTTPException(404, str(exc.args[0])) from exc

    @app.get("/v1/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/datasets")
    def list_datasets() -> list[dict[str, Any]]:
        out = []
        for name in catalog.names():
            try:
                out.append(catalog.get(name).describe())
            except DatasetError as exc:
                out.append({"name": name, "error": str(exc)})
        return out

    @app.get("/v1/datasets/{name}")
    def get_dataset(name: str) -> dict[str, Any]:
        try:
            return catalog.get(name).describe()
        except KeyError as exc:
            raise HTTPException(404, str(exc.args[0])) from exc
        except DatasetError as exc:
            raise HTTPException(422, str(exc)) from exc

    @app.post("/v1/jobs", status_code=201, dependencies=needs_token)
    def create_job(body: JobCreate, response: Response) -> dict[str, Any]:
        try:
            dataset = catalog.get(body.dataset)
        except KeyError as exc:
            raise HTTPException(404, str(exc.args[0])) from exc
        except DatasetError as exc:
            raise HTTPException(422, str(exc)) from exc
        try:
            spec = JobSpec(**body.model_dump())
            job, created = jobs.create(spec, dataset.num_samples)
        except JobConflict as exc:
            raise HTTPException(409, str(exc)) from exc
        except (JobError, ValueError) as exc:
            raise HTTPException(422, str(exc)) from exc
        if not created:
            response.status_code = 200
        log.info("job created" if created else "job exists", extra={"job": spec.name})
        return _job_view(job, catalog)

    @app.get("/v1/jobs")
    def list_jobs() -> list[str]:
        return jobs.names()

    @app.get("/v1/jobs/{name}")
    def get_job(name: str) -> dict[str, Any]:
        return _job_view(job_or_404(name), catalog)

    @app.post("/v1/jobs/{name}/generations", dependencies=needs_token)
    def add_generation(name: str, body: GenerationCreate) -> dict[str, Any]:
        job_or_404(name)
        try:
            job = jobs.add_generation(name, Generation(**body.model_dump()))
        except ValueError as exc:
            raise HTTPException(409, str(exc)) from exc
        log.info("new generation", extra={"job": name, **body.model_dump()})
        return _job_view(job, catalog)

    def check_tid(job: Job, dp_rank: int, step: int) -> None:
        try:
            job.check_step(step)
            gen, _ = job.planner.generation_at(step)
        except ValueError as exc:
            raise HTTPException(416, str(exc)) from exc
        if dp_rank >= gen.dp:
            raise HTTPException(
                416, f"dp_rank {dp_rank} out of range: step {step} has dp={gen.dp}"
            )

    @app.get("/v1/jobs/{name}/plan")
    def get_plan(name: str, dp_rank: Annotated[int, Query(ge=0)], step: Annotated[int, Query(ge=0)]) -> dict[str, Any]:
        job = job_or_404(name)
        check_tid(job, dp_rank, step)
        plan = job.planner.plan(dp_rank, step)
        return {"step": step, "dp_rank": dp_rank, "epoch": plan.epoch, "indices": plan.indices.tolist()}

    @app.get(
        "/v1/jobs/{name}/batches",
        response_class=StreamingResponse,
        responses={200: {"content": {MEDIA_TYPE: {}}}},
        dependencies=needs_token,
    )
    async def stream_batches(
        name: str,
        dp_rank: Annotated[int, Query(ge=0)],
        start: Annotated[int, Query(ge=0)],
        count: Annotated[int, Query(ge=1)] = 1,
    ) -> Response:
        """The batches of ``dp_rank`` for steps ``start .. start+count-1`` as one Arrow IPC stream."""
        job = job_or_404(name)
        if count > config.max_steps_per_request:
            raise HTTPException(413, f"count={count} exceeds the limit of {config.max_steps_per_request} steps per request")
        for step in range(start, start + count):
            check_tid(job, dp_rank, step)
        dataset = catalog.opened(job.spec.dataset)
        if dataset is None:
            dataset = await asyncio.get_running_loop().run_in_executor(opener, catalog.get, job.spec.dataset)
        steps = range(start, start + count)

        headers = {"X-FFplane-Steps": f"{start}-{start + count - 1}"}
        if count <= _WHOLE_BODY_STEPS:
            # Few steps: one body with a Content-Length. Chunked streaming costs a chunk header
            # per piece, and measured ~2x slower for single 4 MiB steps.
            parts = list(encode_steps(dataset, job.planner, dp_rank, steps))
            whole = WholeBody(parts, MEDIA_TYPE, headers)
            metrics.bytes.labels(name).inc(whole.nbytes)
            metrics.steps.labels(name).inc(count)
            return whole

        async def body() -> AsyncIterator[bytes | memoryview]:
            for chunk in encode_steps(dataset, job.planner, dp_rank, steps):
                metrics.bytes.labels(name).inc(len(chunk))
                yield chunk  # the loop sends it before the next step is encoded
            metrics.steps.labels(name).inc(count)

        return StreamingResponse(body(), media_type=MEDIA_TYPE, headers=headers)

    # Coordinator endpoints are async: they run on the event loop, one at a time, so membership
    # needs no lock (sync endpoints would run concurrently in the thread pool) and skip a thread hop.
    @app.post("/v1/nodes/heartbeat", dependencies=needs_token)
    async def heartbeat(body: Heartbeat) -> Response:
        """A node daemon's full heartbeat: registers it, records its shard inventory and workers.
        Answers the ring view (ring, members' addresses, dead nodes, this node's successor) and
        the UDP port for its next beats."""
        udp = body.udp.model_dump() if body.udp is not None else None
        coordinator.heartbeat(body.node_id, body.address, body.budget_bytes, body.inventory, body.workers, body.exited, udp)
        return Response(coordinator.view_bytes(body.node_id), media_type="application/json")

    @app.get("/v1/nodes/view")
    async def nodes_view(node_id: str | None = None) -> Response:
        """The ring view, as answered to heartbeats (with ``node_id``: that node's successor)."""
        return Response(coordinator.view_bytes(node_id), media_type="application/json")

    @app.get("/v1/nodes")
    async def nodes() -> dict[str, Any]:
        return {
            "ring": coordinator.ring(),
            "members": {n: {"address": m.address, "alive": m.alive} for n, m in coordinator.members.items()},
            "udp_port": coordinator.udp_port,
            "stats": coordinator.stats,
        }

    @app.get("/v1/nodes/{node_id}")
    async def node(node_id: str) -> dict[str, Any]:
        m = coordinator.members.get(node_id)
        if m is None:
            raise HTTPException(404, f"unknown node {node_id!r}; it has never sent a heartbeat")
        return {"node_id": node_id, "address": m.address, "alive": m.alive, "silent_s": round(time.monotonic() - m.last_seen, 3), "http_beats": m.http_beats, "udp_beats": m.udp_beats}

    @app.get("/v1/jobs/{name}/status")
    async def job_status(name: str) -> dict[str, Any]:
        """Members, ring, dead nodes, restorable step and per-role shard locations of a job."""
        return coordinator.status(name)

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
