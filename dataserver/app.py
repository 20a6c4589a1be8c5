"""The data server's HTTP API (FastAPI): datasets, jobs, plans and the batch stream.

Every integer a client sends has a bound in the schema and every name a length (and a pattern),
integers are strict (``true`` is not 1), and each route documents the 4xx codes it answers, all
with a ``{"detail": str}`` body that says what to change. Requests that carry a body are judged
on their token and size before the body is read (``httpserver.BodyGuard``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import aiohttp
from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request, Response
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from pydantic import BaseModel, ConfigDict, Field, StrictBool
from starlette.exceptions import HTTPException as StarletteHTTPException

from dataserver.catalog import Catalog, DatasetError
from dataserver.cluster_view import cluster_view
from dataserver.config import ServeConfig
from dataserver.coordinator import (
    AddressError,
    Coordinator,
    MembershipConflict,
    listen_udp,
)
from dataserver.dead_board import DeadBoard
from dataserver.jobs import (
    LAYOUT_LIMIT,
    SEED_LIMIT,
    BrokenJob,
    Job,
    JobBroken,
    JobConflict,
    JobError,
    JobRegistry,
    JobSpec,
)
from dataserver.leadership import Leadership
from dataserver.planner import Generation, Planner
from dataserver.shared_jobs import EtcdJobRegistry
from dataserver.status_page import STATUS_PAGE
from dataserver.stream import MEDIA_TYPE, StepEncoder, WholeBody, encode_steps
from ffplane_contract.auth import load_token
from ffplane_contract.limits import MAX_COUNT, NAME_PATTERN, STEP_LIMIT
from ffplane_contract.servers import LEADER_HEADER
from ffplane_contract.settings import version
from ffplane_runtime.etcd import ALIVE_KEY, Etcd, EtcdUnavailable
from ffplane_runtime.httpserver import BearerAuth, BodyGuard, offline_docs

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_WHOLE_BODY_STEPS = 4
_WHOLE_RUN_BYTES = 4 << 20  # a run of small steps (a daemon's prefetch) is one body up to this size, whatever its count
# The whole-body path materialises the response; above this (estimated) size it streams instead.
_WHOLE_BODY_BYTES = 64 << 20
# A step estimated above this is encoded on a worker thread, so the event loop (health checks,
# heartbeats) keeps answering while it is gathered; smaller steps are encoded on the loop, which
# measured faster for the usual ~4 MiB steps (docs/decisions.md, "Data path, fourth pass").
_INLINE_STEP_BYTES = 16 << 20
_ADMIT_ATTEMPTS = 4  # a request re-checked this often when other servers keep changing its job's plan
_NAME_LEN = 128
_PROBE_S = 1.5  # how long the coordinator waits for a reported node's health check
_REPROBE_S = 2.0  # how often unreachable members are checked again

Name = Annotated[str, Field(min_length=1, max_length=_NAME_LEN, pattern=NAME_PATTERN)]
PathName = Annotated[str, Path(min_length=1, max_length=_NAME_LEN, pattern=NAME_PATTERN, description="a job or dataset name")]
DpRank = Annotated[int, Query(ge=0, lt=LAYOUT_LIMIT)]
Step = Annotated[int, Query(ge=0, lt=STEP_LIMIT)]
Count = Annotated[int, Query(ge=1, le=MAX_COUNT)]
NodeId = Annotated[str, Path(min_length=1, max_length=_NAME_LEN, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")]


class ErrorDetail(BaseModel):
    """Every 4xx answer: what was wrong and what to do about it."""

    detail: str


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    what = {
        401: "missing or wrong bearer token",
        404: "unknown dataset, job or node",
        409: "conflicts with the job or membership as it is (the message names what)",
        413: "request too large: body, steps or bytes per request",
        416: "step or dp rank outside the job",
        421: f"this data server does not coordinate now; the {LEADER_HEADER} header names the one that does",
        415: "the body is not sent as application/json",
        422: "invalid request: the message names the field and the bound",
        503: "the server cannot serve this now (the message says why)",
    }
    return {c: {"model": ErrorDetail, "description": what[c]} for c in codes}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class JobCreate(_Strict):
    name: Name
    dataset: Name
    dp: int = Field(ge=1, le=LAYOUT_LIMIT)
    batch_per_rank: int = Field(ge=1, le=LAYOUT_LIMIT)
    seed: int = Field(default=0, ge=0, lt=SEED_LIMIT, description="any unsigned 64-bit integer")
    max_steps: int | None = Field(default=None, ge=1, le=STEP_LIMIT)


class GenerationCreate(_Strict):
    start_step: int = Field(ge=1, lt=STEP_LIMIT)
    dp: int = Field(ge=1, le=LAYOUT_LIMIT)
    batch_per_rank: int = Field(ge=1, le=LAYOUT_LIMIT)
    replan_served: StrictBool = Field(
        default=False,
        description="accept a start at or before the newest step served: the batches served from start_step on "
        "were only prefetched by node caches and no worker trained on them (never before a committed step)",
    )


class UnreachableReport(_Strict):
    reporter: str = Field(min_length=1, max_length=_NAME_LEN, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")  # the node that could not connect


class UnreachableAnswer(BaseModel):
    node_id: str
    unreachable: bool  # whether the node is out of the ring now
    detail: str


class UdpSession(_Strict):
    session: str = Field(pattern=r"^[0-9a-f]{16}$")  # the daemon process's random UDP session id
    counter: int = Field(ge=0, lt=1 << 64)  # the highest message counter it has used
    inv_version: int = Field(ge=0, lt=1 << 64)  # the version of the inventory in this heartbeat


class Heartbeat(_Strict):
    model_config = ConfigDict(strict=True, extra="ignore")
    node_id: str = Field(min_length=1, max_length=_NAME_LEN, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
    address: str = Field(
        min_length=1,
        max_length=256,
        pattern=r"^https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?/?$",
        description="http://HOST:PORT its peers reach it at (not loopback across hosts, not 0.0.0.0)",
    )
    budget_bytes: int = Field(ge=0, lt=1 << 62)
    # The per-job records: each is checked on its own by the coordinator (dataserver.records), so
    # one that fails is dropped and named in the answer, not the whole heartbeat.
    inventory: dict[str, Any] = Field(
        default_factory=dict, max_length=1024, description="job → role → committed versions held on the node (InventoryEntry)"
    )
    workers: list[Any] = Field(default_factory=list, max_length=4096, description="the node's workers (WorkerInfo)")
    exited: list[Any] = Field(default_factory=list, max_length=4096, description="workers that exited since the last one (WorkerInfo)")
    udp: UdpSession | None = None  # present when the daemon will send UDP beats


class DroppedRecord(BaseModel):
    job: str  # "" when the record names none
    record: str  # where it was: inventory.JOB.ROLE[i], inventory.JOB, workers[i], exited[i]
    reason: str


class RingView(BaseModel):
    epoch: int
    version: int
    ring: list[str]
    members: dict[str, str]
    dead: list[str]
    successor: str | None
    successor_address: str | None
    udp_port: int | None
    dropped: list[DroppedRecord] | None = None  # a heartbeat's answer: the records it left out (the first 32), if any
    dropped_count: int | None = None  # how many it left out


class GenerationView(BaseModel):
    start_step: int
    dp: int
    batch_per_rank: int


class JobView(BaseModel):
    name: str
    dataset: dict[str, Any] | None = Field(description="the dataset's description, or {name, error} if it cannot be opened")
    seed: int | None
    max_steps: int | None
    generations: list[GenerationView]
    served_step: int | None = Field(description="the newest step whose batches were handed out; a generation must start after it")
    broken: str | None = Field(default=None, description="why the job's record could not be loaded; it serves nothing until fixed")


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.steps = Counter("ffplane_dataserver_steps_served", "Batches (one per TID) streamed", ["job"], registry=self.registry)
        self.bytes = Counter("ffplane_dataserver_bytes_served", "Arrow IPC bytes streamed", ["job"], registry=self.registry)
        self.detection = Histogram(
            "ffplane_coordinator_detection_seconds",
            "Silence before a node was declared dead (heartbeat gap + sweep)",
            buckets=(0.5, 1, 1.5, 2, 2.5, 3, 5, 10, 30),
            registry=self.registry,
        )

    def watch(self, coordinator: Coordinator, leading: Callable[[], bool]) -> None:
        coordinator.on_declared_dead = self.detection.observe
        self.registry.register(_CoordinatorCollector(coordinator, leading))


class _CoordinatorCollector:
    """Membership as this server's coordinator sees it (only meaningful on the leader)."""

    def __init__(self, coordinator: Coordinator, leading: Callable[[], bool]) -> None:
        self.coordinator, self.leading = coordinator, leading

    def describe(self) -> list[Any]:
        return []  # collected fresh each scrape (the registry must not call collect() at register time)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        c = self.coordinator
        yield GaugeMetricFamily("ffplane_coordinator_leading", "1 when this data server coordinates now", value=1 if self.leading() else 0)
        members = GaugeMetricFamily("ffplane_coordinator_members", "Nodes by state", labels=["state"])
        ms = list(c.members.values())
        members.add_metric(["alive"], sum(1 for m in ms if m.alive and not m.unreachable))
        members.add_metric(["unreachable"], sum(1 for m in ms if m.unreachable))
        members.add_metric(["dead"], sum(1 for m in ms if not m.alive))
        yield members
        yield GaugeMetricFamily("ffplane_coordinator_ring_size", "Nodes in the replication ring", value=len(c.ring()))
        beats = CounterMetricFamily("ffplane_coordinator_heartbeats", "Heartbeats received, by kind", labels=["kind"])
        for kind, n in sorted(c.stats.items()):
            beats.add_metric([kind], n)
        yield beats
        yield CounterMetricFamily("ffplane_coordinator_worker_exits", "Worker exits reported by daemons", value=len(c.worker_exits))
        yield CounterMetricFamily(
            "ffplane_coordinator_records_dropped", "Heartbeat records left out for failing their check", value=c.drop_log.total
        )


@dataclass
class _Lead:
    leading: bool  # whether this server coordinates now
    settled_at: float = 0.0  # monotonic time from which it answers ring views (see create_app)


def _describe(catalog: Catalog, dataset: str) -> dict[str, Any]:
    try:
        return catalog.get(dataset).describe()
    except KeyError:
        return {"name": dataset, "error": f"dataset {dataset!r} is not in the data directory any more"}
    except (DatasetError, OSError) as exc:
        return {"name": dataset, "error": str(exc)}


def _job_view(job: Job, catalog: Catalog) -> JobView:
    spec = job.spec
    return JobView(
        name=spec.name,
        dataset=_describe(catalog, spec.dataset),
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


def _validation_detail(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:8]:
        loc = ".".join(str(x) for x in err.get("loc", ()))
        if err.get("type") == "string_pattern_mismatch":
            parts.append(f"{loc}: {str(err.get('input'))[:140]!r} must match {err.get('ctx', {}).get('pattern')}")
        else:
            parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def create_app(config: ServeConfig, token: str | None = None) -> FastAPI:
    """The data server app; ``token`` defaults to the configured token file or environment."""
    catalog = Catalog(config.data_dir)
    etcd = Etcd(config.etcd) if config.etcd else None
    jobs = JobRegistry(config.resolved_state_dir()) if etcd is None else EtcdJobRegistry(etcd, config.resolved_state_dir())
    auth = BearerAuth(token if token is not None else load_token(config.token_file))
    metrics = _Metrics()
    coordinator = Coordinator(config.dead_after_s, auth.token, forget_after_s=config.forget_dead_after_s)
    # With etcd, several servers may serve the same jobs and one at a time coordinates; a server
    # that just took over answers no ring view until the daemons' heartbeats have had time to
    # find it, so none is handed a ring missing nodes that are alive (shared_jobs, leadership).
    settle_s = max(config.dead_after_s, 1.0) + 0.5
    lead = _Lead(leading=etcd is None)
    metrics.watch(coordinator, lambda: lead.leading)

    def on_lead_change(leading: bool, took_over: bool) -> None:
        coordinator.reset()
        lead.leading, lead.settled_at = leading, time.monotonic() + (settle_s if took_over else 0.0)
        if leading and took_over and etcd is not None:
            expect_previous(etcd)

    def expect_previous(etcd: Etcd) -> None:
        """The nodes the previous coordinator had alive join the ring at once, and one that never
        beats here (lost in the hand-over) is declared dead like any other. Read here, on the
        loop, before this server's dead board can overwrite the key."""
        try:
            kv = etcd.get(ALIVE_KEY, retry_s=1.0)
            members = json.loads(kv.value) if kv is not None else {}
            if not isinstance(members, dict):
                raise ValueError(f"not a JSON object: {kv.value[:80]!r}" if kv is not None else "")
        except (EtcdUnavailable, ValueError) as exc:
            log.warning("cannot read the previous coordinator's nodes; they register with their next heartbeat", extra={"error": str(exc)})
            return
        added = coordinator.expect({str(n): str(a) for n, a in members.items()}, settle_s)
        log.info("expecting the previous coordinator's nodes", extra={"nodes": added})

    leadership = Leadership(etcd, config.url(config.port), on_lead_change) if etcd is not None else None

    needs_token = [Depends(auth)]  # the body and its size are judged by BodyGuard before this
    secured: dict[str, Any] = {"security": [{"bearer": []}]}
    # Batches are encoded on the event loop, step by step (~0.5 ms per 4 MiB): with a thread
    # per concurrent request the GIL changed hands ~250 times per step (futex storm, 2.6 ms of
    # system time), and even one encoder thread's hand-offs cost more than they overlapped on
    # 2 cores (docs/decisions.md, "Data path, fourth pass"). Opening a dataset, which can take
    # seconds, still runs off the loop, on this one thread; steps too big to encode without
    # stalling the loop run on the other.
    opener = ThreadPoolExecutor(1, thread_name_prefix="open-dataset")
    big_steps = ThreadPoolExecutor(1, thread_name_prefix="encode-big-step")

    async def answers(address: str) -> bool:
        """Whether a daemon's peer port answers the coordinator (its health check, within 1.5 s)."""
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_PROBE_S)) as session,
                session.get(f"{address}/v1/health") as resp,
            ):
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return False

    async def reprobe() -> None:
        """Members taken out of the ring as unreachable go back once they answer again."""
        while True:
            await asyncio.sleep(_REPROBE_S)
            for node_id, address in coordinator.unreachable().items():
                if await answers(address):
                    coordinator.set_unreachable(node_id, False)

    async def sweep() -> None:
        due = time.monotonic()
        while True:
            # A sweep that runs late (the loop stalled) declares nobody dead: beats queued in the
            # socket during the stall are read first, and the next sweep judges.
            if time.monotonic() - due < config.sweep_s:
                coordinator.sweep()
            due = time.monotonic() + config.sweep_s
            await asyncio.sleep(config.sweep_s)

    def num_samples_of(dataset: str) -> int:
        return catalog.get(dataset).num_samples

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        names = jobs.load(num_samples_of)
        log.info(
            "dataserver ready", extra={"datasets": catalog.names(), "jobs": names, "broken_jobs": sorted(set(jobs.names()) - set(names))}
        )
        tasks = [asyncio.create_task(sweep(), name="coordinator sweep"), asyncio.create_task(reprobe(), name="coordinator reprobe")]
        if etcd is not None and leadership is not None:
            leadership.url = config.url(config.port)  # the port bound, for --port 0
            await leadership.start()
            tasks.append(asyncio.create_task(leadership.run(), name="leadership"))
            tasks.append(asyncio.create_task(DeadBoard(etcd, coordinator, lambda: lead.leading).run(config.sweep_s), name="dead board"))
        udp = None
        if config.heartbeat_udp_port >= 0 and auth.token is not None:
            udp = await listen_udp(coordinator, config.host, config.heartbeat_udp_port)
        yield
        if udp is not None:
            udp.close()
        for task in tasks:
            task.cancel()
        if leadership is not None:
            await leadership.resign()
        opener.shutdown(wait=True, cancel_futures=True)
        big_steps.shutdown(wait=True, cancel_futures=True)
        catalog.close()

    app = FastAPI(title="ffplane dataserver", version=version(), lifespan=lifespan, docs_url=None, redoc_url=None)
    offline_docs(app)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        kind = request.headers.get("content-type", "")
        if request.method in ("POST", "PUT") and not kind.startswith("application/json"):
            # curl -d sends a form content type; the JSON body was never read as JSON
            detail = f"the body must be JSON sent with Content-Type: application/json (got {kind or 'none'!r}; curl: -H 'Content-Type: application/json')"
            return JSONResponse({"detail": detail}, status_code=415)
        return JSONResponse({"detail": _validation_detail(exc)}, status_code=422)

    @app.exception_handler(EtcdUnavailable)
    async def etcd_down(request: Request, exc: EtcdUnavailable) -> JSONResponse:
        # job records live in etcd (--etcd): without a quorum nothing can be read or recorded
        return JSONResponse({"detail": f"job records cannot be reached: {exc}"}, status_code=503)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 400:  # FastAPI's answer to a body it cannot decode (not UTF-8)
            return JSONResponse({"detail": "the body could not be decoded: send a UTF-8 JSON object"}, status_code=422)
        return await http_exception_handler(request, exc)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {})["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer", "description": "the job token ($FFPLANE_TOKEN)"}
            }
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    def coordinating() -> None:
        """Coordinator endpoints: answered by the server that coordinates; the others say which does."""
        if not lead.leading:
            leader = leadership.leader if leadership is not None else None
            where = f"send it to {leader}" if leader and leader != config.url(config.port) else "no server coordinates yet; retry shortly"
            raise HTTPException(421, f"this data server does not coordinate now: {where}", headers={LEADER_HEADER: leader or ""})

    def settled() -> None:
        """A server that just took over answers no ring view or restore status for a moment (the
        daemons' heartbeats are still finding it; see create_app)."""
        left = lead.settled_at - time.monotonic()
        if left > 0:
            raise HTTPException(
                503, f"this data server took over coordination and is collecting the nodes' heartbeats; retry in {left:.1f} s"
            )

    leader_only = [Depends(coordinating)]

    # Registry calls from async routes: inline for the file registry, off the loop for etcd (a
    # network round trip). etcd without a quorum answers 503 through ``etcd_down``.
    async def registry(fn: Callable[..., _T], *args: Any) -> _T:
        return fn(*args) if etcd is None else await asyncio.to_thread(fn, *args)

    def job_or_error(name: str) -> Job:
        try:
            return jobs.get(name)
        except KeyError as exc:
            raise HTTPException(404, str(exc.args[0])) from exc
        except JobBroken as exc:
            raise HTTPException(409, str(exc)) from exc

    async def job_or_error_async(name: str) -> Job:
        if not jobs.known(name):  # a job another data server created: its record is read first
            await registry(jobs.find, name)
        return job_or_error(name)

    def layout_refusal(dp: int, batch_per_rank: int, sample_bytes: int) -> str | None:
        if dp * batch_per_rank > config.max_samples_per_step:
            return (
                f"dp={dp} x batch_per_rank={batch_per_rank} = {dp * batch_per_rank} samples per step exceeds "
                f"this server's limit of {config.max_samples_per_step} (--max-samples-per-step)"
            )
        if batch_per_rank * sample_bytes > config.max_bytes_per_request:
            return (
                f"one rank's step of batch_per_rank={batch_per_rank} samples of ~{sample_bytes} bytes would be "
                f"{batch_per_rank * sample_bytes} bytes, over the limit of {config.max_bytes_per_request} bytes per "
                f"request (--max-bytes-per-request); lower batch_per_rank"
            )
        return None

    @app.get("/v1/health")
    @app.get("/healthz", include_in_schema=False)
    async def health() -> dict[str, str]:
        """Liveness: the process serves HTTP."""
        return {"status": "ok"}

    @app.get("/readyz", include_in_schema=False)
    async def ready() -> JSONResponse:
        """Readiness: the datasets folder is there and, with --etcd, the job records can be read."""
        why = None
        if not config.data_dir.is_dir():
            why = f"--data-dir {config.data_dir} is not a directory"
        elif etcd is not None:
            try:
                await asyncio.to_thread(etcd.get, b"/ffplane/ready-probe", 0.0)
            except EtcdUnavailable as exc:
                why = f"etcd cannot be reached: {exc}"
        return JSONResponse({"status": "ready"} if why is None else {"detail": why}, status_code=200 if why is None else 503)

    @app.get("/v1/leader")
    async def leader() -> dict[str, Any]:
        """Whether this server coordinates, and which one does (with several data servers)."""
        url = config.url(config.port)
        return {"url": url, "leading": lead.leading, "leader": leadership.leader if leadership is not None else url}

    @app.get("/v1/datasets")
    def list_datasets() -> list[dict[str, Any]]:
        return [_describe(catalog, name) for name in catalog.names()]

    @app.get("/v1/datasets/{name}", responses=_errors(404, 422))
    def get_dataset(name: PathName) -> dict[str, Any]:
        try:
            return catalog.get(name).describe()
        except KeyError as exc:
            raise HTTPException(404, str(exc.args[0])) from exc
        except (DatasetError, OSError) as exc:
            raise HTTPException(422, str(exc)) from exc

    @app.post(
        "/v1/jobs",
        status_code=201,
        dependencies=needs_token,
        responses={200: {"model": JobView, "description": "the same job existed already"}, **_errors(401, 404, 409, 413, 422, 415)},
        openapi_extra=secured,
    )
    def create_job(body: JobCreate, response: Response) -> JobView:
        try:
            dataset = catalog.get(body.dataset)
            sample_bytes = catalog.sample_bytes(body.dataset)
        except KeyError as exc:
            raise HTTPException(404, str(exc.args[0])) from exc
        except (DatasetError, OSError) as exc:
            raise HTTPException(422, str(exc)) from exc
        refused = layout_refusal(body.dp, body.batch_per_rank, sample_bytes)
        if refused is not None:
            raise HTTPException(422, refused)
        try:
            spec = JobSpec(**body.model_dump())
            job, created = jobs.create(spec, dataset.num_samples)
        except JobConflict as exc:  # JobBroken is one
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

    @app.get("/v1/jobs/{name}", responses=_errors(404, 422))
    def get_job(name: PathName) -> JobView:
        jobs.refresh(name)  # other data servers may have changed it
        broken = jobs.broken(name)
        if broken is not None:
            return _broken_view(broken)
        return _job_view(job_or_error(name), catalog)

    @app.delete("/v1/jobs/{name}", status_code=204, dependencies=needs_token, responses=_errors(401, 404, 422), openapi_extra=secured)
    def delete_job(name: PathName) -> Response:
        """Forget the job's record and served steps; batches of it are no longer served. The
        node daemons keep its checkpoints (their /v1/state lists them) until their roots are wiped."""
        if not jobs.delete(name):
            raise HTTPException(404, f"unknown job {name!r}")
        log.info("job deleted", extra={"job": name})
        return Response(status_code=204)

    # Async: the committed step comes from the coordinator, which lives on the event loop.
    @app.post(
        "/v1/jobs/{name}/generations",
        dependencies=[*needs_token, *leader_only],
        responses=_errors(401, 404, 409, 413, 421, 422, 503, 415),
        openapi_extra=secured,
    )
    async def add_generation(name: PathName, body: GenerationCreate) -> JobView:
        job = await job_or_error_async(name)
        try:
            sample_bytes = catalog.known_sample_bytes(job.spec.dataset)
            if sample_bytes is None:
                sample_bytes = await asyncio.get_running_loop().run_in_executor(opener, catalog.sample_bytes, job.spec.dataset)
        except KeyError as exc:
            raise HTTPException(409, f"job {name!r}'s dataset is gone: {exc.args[0]}") from exc
        except (DatasetError, OSError) as exc:
            raise HTTPException(409, f"job {name!r}'s dataset cannot be read: {exc}") from exc
        refused = layout_refusal(body.dp, body.batch_per_rank, sample_bytes)
        if refused is not None:
            raise HTTPException(422, refused)
        gen = Generation(body.start_step, body.dp, body.batch_per_rank)
        newest = coordinator.newest_step(name)
        try:
            job = await registry(jobs.add_generation, name, gen, newest, body.replan_served)
        except JobConflict as exc:
            raise HTTPException(409, str(exc)) from exc
        except JobError as exc:
            raise HTTPException(422, str(exc)) from exc
        log.info("new generation", extra={"job": name, **body.model_dump()})
        return _job_view(job, catalog)

    def check_tid(job: Job, dp_rank: int, step: int, planner: Planner | None = None) -> Generation:
        try:
            job.check_step(step)
            gen, _ = (planner or job.planner).generation_at(step)
        except ValueError as exc:
            raise HTTPException(416, str(exc)) from exc
        if dp_rank >= gen.dp:
            raise HTTPException(416, f"dp_rank {dp_rank} out of range: step {step} has dp={gen.dp}")
        return gen

    @app.get("/v1/jobs/{name}/plan", responses=_errors(404, 409, 416, 422))
    def get_plan(name: PathName, dp_rank: DpRank, step: Step) -> dict[str, Any]:
        jobs.refresh(name)  # other data servers may have changed it
        job = job_or_error(name)
        check_tid(job, dp_rank, step)
        plan = job.planner.plan(dp_rank, step)
        return {"step": step, "dp_rank": dp_rank, "epoch": plan.epoch, "indices": plan.indices.tolist()}

    @app.get(
        "/v1/jobs/{name}/batches",
        response_class=StreamingResponse,
        responses={200: {"content": {MEDIA_TYPE: {}}}, **_errors(401, 404, 409, 413, 416, 422, 503)},
        dependencies=needs_token,
        openapi_extra=secured,
    )
    async def stream_batches(name: PathName, dp_rank: DpRank, start: Step, count: Count = 1) -> Response:
        """The batches of ``dp_rank`` for steps ``start .. start+count-1`` as one Arrow IPC stream."""
        job = await job_or_error_async(name)
        if count > config.max_steps_per_request:
            raise HTTPException(413, f"count={count} exceeds the limit of {config.max_steps_per_request} steps per request")
        steps = range(start, start + count)
        dataset = catalog.opened(job.spec.dataset)  # a job's dataset is fixed: plans change, not it
        sample_bytes = catalog.known_sample_bytes(job.spec.dataset)
        try:
            if dataset is None or sample_bytes is None:
                dataset = await asyncio.get_running_loop().run_in_executor(opener, catalog.get, job.spec.dataset)
                sample_bytes = await asyncio.get_running_loop().run_in_executor(opener, catalog.sample_bytes, job.spec.dataset)
        except KeyError as exc:
            raise HTTPException(409, f"job {name!r}'s dataset is gone: {exc.args[0]}") from exc
        except (DatasetError, OSError) as exc:
            raise HTTPException(503, f"job {name!r}'s dataset cannot be read: {exc}") from exc
        for _ in range(_ADMIT_ATTEMPTS):
            planner = job.planner
            step_bytes = [check_tid(job, dp_rank, step, planner).batch_per_rank * sample_bytes for step in steps]
            total = sum(step_bytes)
            if total > config.max_bytes_per_request:
                fit = max(1, config.max_bytes_per_request // max(step_bytes))
                raise HTTPException(
                    413,
                    f"{count} steps of ~{max(step_bytes)} bytes each would be ~{total} bytes, over the limit of "
                    f"{config.max_bytes_per_request} bytes per request; ask for count={fit} or fewer",
                )
            try:
                if await jobs.admit(job, start + count - 1, planner):  # recorded served before any byte leaves
                    break
            except (OSError, JobConflict) as exc:
                raise HTTPException(503, f"cannot record the served step of job {name!r}: {exc}") from exc
            job = job_or_error(name)  # another data server changed the job's plan: check the request again
        else:
            raise HTTPException(503, f"job {name!r}'s plan kept changing under this request; ask again")

        headers = {"X-FFplane-Steps": f"{start}-{start + count - 1}"}
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
                    parts = await loop.run_in_executor(big_steps, encoder.step, step)
                else:
                    parts = encoder.step(step)
                for chunk in parts:
                    metrics.bytes.labels(name).inc(len(chunk))
                    yield chunk  # the loop sends it before the next step is encoded
            for chunk in encoder.close():
                yield chunk
            metrics.steps.labels(name).inc(count)

        return StreamingResponse(body(), media_type=MEDIA_TYPE, headers=headers)

    # Coordinator endpoints are async: they run on the event loop, one at a time, so membership
    # needs no lock (sync endpoints would run concurrently in the thread pool) and skip a thread hop.
    @app.post(
        "/v1/nodes/heartbeat",
        dependencies=[*needs_token, *leader_only],
        response_class=Response,
        responses={200: {"model": RingView}, **_errors(401, 409, 413, 421, 422, 503, 415)},
        openapi_extra=secured,
    )
    async def heartbeat(body: Heartbeat, request: Request) -> Response:
        """A node daemon's full heartbeat: registers it, records its shard inventory and workers.
        Answers the ring view (ring, members' addresses, dead nodes, this node's successor) and
        the UDP port for its next beats. A record (one job's version, role or job, one worker)
        that fails its check is left out and the rest taken; the answer's ``dropped`` names it."""
        udp = body.udp.model_dump() if body.udp is not None else None
        client = request.client.host if request.client is not None else None
        try:
            drops = coordinator.heartbeat(
                body.node_id, body.address, body.budget_bytes, body.inventory, body.workers, body.exited, udp, client_host=client
            )
        except AddressError as exc:
            raise HTTPException(422, str(exc)) from exc
        except MembershipConflict as exc:
            raise HTTPException(409, str(exc)) from exc
        settled()  # recorded, but no view yet from a server that just took over
        view = coordinator.view_bytes(body.node_id)
        if drops.count:
            view = view[:-1] + b"," + json.dumps(drops.answer(), separators=(",", ":")).encode()[1:]
        return Response(view, media_type="application/json")

    @app.post(
        "/v1/nodes/{node_id}/unreachable",
        dependencies=[*needs_token, *leader_only],
        responses=_errors(401, 404, 413, 421, 422, 415),
        openapi_extra=secured,
    )
    async def unreachable(node_id: NodeId, body: UnreachableReport) -> UnreachableAnswer:
        """A daemon reports that its ring successor ``node_id`` beats but takes no connection. The
        coordinator checks for itself: if the node does not answer it either, it leaves the ring
        (its predecessor replicates past it) until a later check finds it answering."""
        m = coordinator.members.get(node_id)
        if m is None or not m.alive:
            raise HTTPException(404, f"node {node_id!r} is not a live member; nothing to do")
        if m.unreachable:
            return UnreachableAnswer(node_id=node_id, unreachable=True, detail="out of the ring already")
        if await answers(m.address):
            return UnreachableAnswer(
                node_id=node_id, unreachable=False, detail=f"{m.address} answers the coordinator; the reporter's own link may be at fault"
            )
        coordinator.set_unreachable(node_id, True)
        log.warning("node reported unreachable and confirmed", extra={"node": node_id, "reporter": body.reporter, "address": m.address})
        return UnreachableAnswer(node_id=node_id, unreachable=True, detail=f"{m.address} does not answer; out of the ring until it does")

    @app.get(
        "/v1/nodes/view", response_class=Response, responses={200: {"model": RingView}, **_errors(421, 422, 503)}, dependencies=leader_only
    )
    async def nodes_view(node_id: Annotated[str | None, Query(max_length=_NAME_LEN)] = None) -> Response:
        """The ring view, as answered to heartbeats (with ``node_id``: that node's successor)."""
        settled()
        return Response(coordinator.view_bytes(node_id), media_type="application/json")

    @app.get("/v1/nodes", responses=_errors(421), dependencies=leader_only)
    async def nodes() -> dict[str, Any]:
        return {
            "ring": coordinator.ring(),
            "members": {n: {"address": m.address, "alive": m.alive, "unreachable": m.unreachable} for n, m in coordinator.members.items()},
            "udp_port": coordinator.udp_port,
            "stats": coordinator.stats,
        }

    @app.get("/v1/nodes/{node_id}", responses=_errors(404, 421, 422), dependencies=leader_only)
    async def node(node_id: NodeId) -> dict[str, Any]:
        m = coordinator.members.get(node_id)
        if m is None:
            raise HTTPException(404, f"unknown node {node_id!r}; it has never sent a heartbeat (or was dead long enough to be forgotten)")
        return {
            "node_id": node_id,
            "address": m.address,
            "alive": m.alive,
            "silent_s": round(time.monotonic() - m.last_seen, 3),
            "http_beats": m.http_beats,
            "udp_beats": m.udp_beats,
        }

    @app.get("/v1/jobs/{name}/status", responses=_errors(421, 422, 503), dependencies=leader_only)
    async def job_status(name: PathName) -> dict[str, Any]:
        """Members, ring, dead nodes, restorable step and per-role shard locations of a job, and
        the newest step any daemon ever reported committed (``committed_step``, kept across
        restarts of this server): a restore that finds nothing although it is set must fail."""
        settled()
        status = coordinator.status(name)
        newest = coordinator.newest_step(name)
        job = await registry(jobs.find, name)
        if job is not None:
            await registry(jobs.note_committed, job, newest)
        status["committed_step"] = job.committed_step if job is not None else newest
        return status

    @app.get("/v1/cluster", responses=_errors(421, 503), dependencies=leader_only)
    async def cluster() -> dict[str, Any]:
        """Nodes, ring, each live daemon's roles, replicas, cache and gate, each job's restorable
        step and shard locations, recent failures and their recovery (the status page's data)."""
        settled()
        names = await registry(jobs.names)
        return await cluster_view(coordinator, names, config.url(config.port))

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def status_page() -> HTMLResponse:
        """The status page: plain HTML and a little JS polling /v1/cluster (no CDN)."""
        return HTMLResponse(STATUS_PAGE)

    @app.get("/metrics", response_class=PlainTextResponse, responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}}})
    def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(BodyGuard, auth=auth, max_body_bytes=config.max_body_bytes)
    return app
