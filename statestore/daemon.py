"""The node daemon: wires the data cache, the control socket and the read-only ops HTTP API."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import IO, Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi import Path as PathParam
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from dataserver.httpserver import BearerAuth
from statestore import shm
from statestore.config import DaemonConfig
from statestore.control import ControlServer
from statestore.data_cache import DataCache
from statestore.heartbeat import Heartbeat
from statestore.index import Index
from statestore.link_gate import LinkGate
from statestore.metrics import registry_for
from statestore.names import NAME_PATTERN, check_name, check_step
from statestore.rebuild import QUARANTINE, Rebuilt, rebuild, set_aside
from statestore.replicas import ReplicaStore
from statestore.replication import LocalShard, Replicator, _Peers, read_meta_prefix
from statestore.slots import SlotError, SlotStore
from statestore.state_service import DurableConfig, StateService

log = logging.getLogger(__name__)


class Daemon:
    """Everything one node daemon owns. ``prepare()`` runs before serving and may refuse."""

    def __init__(self, config: DaemonConfig, token: str | None) -> None:
        config.validate()
        self.config = config
        self.token = token
        self._lock: IO[bytes] | None = None
        self.index: Index | None = None
        self.cache: DataCache | None = None
        self.state: StateService | None = None
        self.control: ControlServer | None = None
        self.heartbeat: Heartbeat | None = None
        self.gate: LinkGate | None = None
        self.address = ""  # the ops/peer base URL, once bound
        self.huge_pages = "never"  # the root tmpfs's huge= option, read at prepare()
        self.rebuilt: Rebuilt | None = None  # what a rebuild of a lost index found, if one ran
        self._tasks: list[asyncio.Task[None]] = []

    def prepare(self) -> None:
        """Lock the root, reclaim stale files, reattach, and check the tmpfs has room. A refused
        start leaves the root as it found it (no lock file, no index it created)."""
        root = self.config.root
        created_root, had_index = not root.exists(), (root / "_index").exists()
        self._lock = shm.acquire_root(root)
        try:
            self._prepare(root)
        except BaseException:
            self._undo(root, created_root, had_index)
            raise

    def _undo(self, root: Path, created_root: bool, had_index: bool) -> None:
        if self.index is not None:
            self.index.close()
            self.index = None
        if not had_index:
            shutil.rmtree(root / "_index", ignore_errors=True)
        (root / "daemon.lock").unlink(missing_ok=True)
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        if created_root:
            with contextlib.suppress(OSError):
                root.rmdir()  # only if this start left nothing else in it

    def _open_index(self, root: Path) -> Index:
        """The root's index; a damaged or missing one is rebuilt from the slot and replica files."""
        index, problem = Index.open_checked(root)
        if index is not None:
            return index
        stamp = time.strftime("%Y%m%dT%H%M%S")
        old = set_aside(root, root / "_index", stamp) if (root / "_index").exists() else None
        index = Index(root)
        self.rebuilt = rebuild(root, index, stamp)
        log.warning(
            f"the index was {problem}: rebuilt it from the slot and replica files; what could not be verified is in "
            f"{root / QUARANTINE / stamp} (delete it once looked at: it takes room in the tmpfs)",
            extra={"versions": self.rebuilt.versions, "replicas": self.rebuilt.replicas, "quarantined": self.rebuilt.quarantined, "old_index": old},
        )
        return index

    def _prepare(self, root: Path) -> None:
        stale = shm.reclaim_stale(root)
        self.index = self._open_index(root)
        self.cache = DataCache(self.config, self.index, self.token)
        kept, dropped = self.cache.reattach()
        cache = self.cache
        budget = self.config.budget_bytes
        replicas = ReplicaStore(root, self.index, lambda: budget - cache.cached_bytes() - slots.slot_bytes() - replicas.held_bytes())
        slots = SlotStore(root, self.index, budget, lambda: cache.cached_bytes() + replicas.held_bytes())
        cache.other_bytes = lambda: slots.slot_bytes() + replicas.held_bytes()
        versions = slots.reattach()
        held = replicas.reattach()
        self.state = StateService(root, slots, replicas, DurableConfig(self.config.durable_dir, self.config.durable_every), self.config.node_id)
        shm.check_room(root, budget, already_ours=cache.cached_bytes() + slots.slot_bytes() + replicas.held_bytes())
        self.huge_pages = shm.huge_pages(root)
        if self.huge_pages not in ("within_size", "always"):
            log.info(
                "the root's tmpfs has 4 KiB pages: readers map cached steps at about half the speed they "
                "would on a tmpfs mounted with huge=within_size (see docs/deployment.md)",
                extra={"root": str(root), "huge": self.huge_pages},
            )
        log.info("root ready", extra={"root": str(root), "huge_pages": self.huge_pages, "reattached_steps": kept, "reattached_versions": versions, "reattached_replicas": held, "dropped": dropped, "stale_tmp": stale})

    async def start(self) -> None:
        assert self.cache is not None
        self.gate = LinkGate(self.config.gate, self.config.root)
        self.cache.gate = self.gate
        await self.cache.start()
        assert self.state is not None
        state = self.state
        self.heartbeat = Heartbeat(self.config, state.slots, self.token)
        self.heartbeat.replicas = state.replicas
        self.heartbeat.address = self.address
        state.peers = _Peers(self.gate, self.token)
        await state.peers.start()
        state.dataserver, state.token, state.gate = self.config.dataserver, self.token, self.gate
        if self.config.replicate:
            state.replicator = Replicator(self.config.node_id, state.slots, state.replicas, self.heartbeat, state.peers, self.config.replica_max_lag, self.config.replica_wait_s, state.quarantine)
            self._tasks.append(asyncio.create_task(state.replicator.run(), name="replicator"))
        self.control = ControlServer(self.cache, state, self.config.socket_path, self.heartbeat)
        await self.control.start()
        self._tasks.append(asyncio.create_task(self.heartbeat.run(), name="heartbeat"))
        log.info("control socket ready", extra={"socket": str(self.config.socket_path)})

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.control is not None:
            await self.control.close()
        if self.cache is not None:
            await self.cache.close()
        if self.state is not None:
            await self.state.close()
            if self.state.peers is not None:
                await self.state.peers.close()
            self.state.slots.close()
            self.state.replicas.close()
        if self.gate is not None:
            self.gate.close()
        if self.index is not None:
            self.index.close()
        if self._lock is not None:
            self._lock.close()


# --- what the HTTP routes take and answer (the OpenAPI spec is checked by schemathesis) ----------
MAX_INT64 = (1 << 63) - 1
META_LIMIT = 64 << 20  # a replica's metadata (its header names every tensor); read_meta_prefix's bound


JobName = Annotated[str, PathParam(pattern=NAME_PATTERN, description="the job's name")]
RoleName = Annotated[str, PathParam(pattern=NAME_PATTERN, description="a role: dp<r>-pp<r>-tp<r>")]
Step = Annotated[int, PathParam(ge=0, le=MAX_INT64, description="the optimizer step the shard was saved at")]
Offset = Annotated[int, Query(ge=0, le=MAX_INT64, description="byte offset in the shard")]
Newest = Annotated[int | None, Query(ge=0, le=MAX_INT64, description="the sender's newest committed step of the role")]


class ErrorDetail(BaseModel):
    detail: str


class ValidationDetail(BaseModel):
    """422: a sentence from the daemon, or FastAPI's list of the parameters that failed validation."""

    detail: str | list[dict[str, Any]]


class ReplicaMeta(BaseModel):
    """What a replica push announces (``begin``'s body, the head of ``whole``'s)."""

    nbytes: int = Field(ge=0, le=MAX_INT64)
    checksum: str = Field(min_length=1, max_length=128)
    header: dict[str, Any]
    source: str = Field(max_length=256)


class Received(BaseModel):
    received: int


class WholeReceived(BaseModel):
    received: int
    checksum: str


class Committed(BaseModel):
    ok: bool
    checksum: str


_WHY = {
    400: "the body does not fit the transfer (it runs past the shard's size)",
    401: "missing or wrong bearer token",
    404: "no such shard on this node",
    409: "the transfer is not in the state this request needs (not begun, already partly here, replaced meanwhile)",
    413: "the body, or the replica it announces, is larger than this daemon can keep (--budget-mb), or has room for now",
    416: "the byte range is outside the shard",
    422: "a parameter or the body is malformed, or a replica's bytes failed their checksum",
    503: "the daemon has no job token configured",
}


def _peer_error(exc: SlotError) -> HTTPException:
    """A state error as a peer API answer. No room *now* (507 on the control socket, where a
    local save turns it into CapacityError) is a 413 here: the request is more than this daemon
    is able to take at the moment, the sender retries later, and no fault of the server is
    reported as a 5xx."""
    return HTTPException(413 if exc.status == 507 else exc.status, str(exc))


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {c: {"model": ValidationDetail if c == 422 else ErrorDetail, "description": _WHY[c]} for c in codes}


_BINARY = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
_BYTES_BODY: dict[str, Any] = {"requestBody": {"required": True, "content": _BINARY}}
_JSON_BODY: dict[str, Any] = {"requestBody": {"required": True, "content": {"application/json": {"schema": ReplicaMeta.model_json_schema()}}}}
_BYTES_REPLY: dict[str, Any] = {
    "description": "the shard's bytes",
    "content": _BINARY,
    "headers": {"X-FFplane-Checksum": {"description": "XXH3-64 of the whole shard", "schema": {"type": "string"}}},
}


def create_app(daemon: Daemon) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await daemon.start()
        yield
        await daemon.stop()

    app = FastAPI(title="ffplane statestore (ops, read-only)", version="0.1.0", lifespan=lifespan)

    @app.get("/v1/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/cache")
    def cache() -> dict[str, Any]:
        """What is cached per dp rank and step, bytes, hits/misses and prefetch lag."""
        assert daemon.cache is not None
        c = daemon.cache
        return {
            "root": str(daemon.config.root),
            "huge_pages": daemon.huge_pages,
            "window": daemon.config.window,
            "budget_bytes": daemon.config.budget_bytes,
            "bytes": c.cached_bytes(),
            "peak_bytes": c.peak_bytes,
            "fetched_bytes": c.bytes_fetched,
            "streams": [s.describe(daemon.config.window) for s in c.streams.values()],
        }

    @app.get("/v1/state")
    def state() -> dict[str, Any]:
        """Roles, committed versions (step, bytes, checksum, slot), unique and razored bytes,
        slot use, and the latency of each save's blocking part and of its commit."""
        assert daemon.state is not None
        slots = daemon.state.slots
        return {
            "slot_bytes": slots.slot_bytes(),
            "budget_bytes": daemon.config.budget_bytes,
            "durable_dir": str(daemon.config.durable_dir) if daemon.config.durable_dir else None,
            "durable_every": daemon.config.durable_every,
            "durable_written": daemon.state.durable_written,
            "node_id": daemon.config.node_id,
            "coordinator": daemon.heartbeat.view if daemon.heartbeat else {},
            "roles": slots.describe(),
            "replicas": daemon.state.replicas.describe(),
            "replication": daemon.state.replicator.describe() if daemon.state.replicator else None,
            "pulled_bytes": daemon.state.pulled_bytes,
        }

    needs_token = [Depends(BearerAuth(daemon.token))]

    def _held(job: str, role: str, step: int) -> LocalShard:
        assert daemon.state is not None
        shard = daemon.state.local(job, role, step)
        if shard is None:
            raise HTTPException(404, f"no committed shard or replica of {role} at step {step} in job {job!r} on this node")
        return shard

    def _bounded_body(request: Request, limit: int) -> None:
        """413 before a byte is read when the declared body is larger than anything this route keeps."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise HTTPException(413, f"a body of {declared} bytes; at most {limit} fit here (the daemon's --budget-mb bounds a replica)")

    @app.get("/v1/state/{job}/{role}/{step}", dependencies=needs_token, responses=_errors(401, 404, 422, 503))
    def shard_meta(job: JobName, role: RoleName, step: Step) -> dict[str, Any]:
        """Size, checksum and header of a shard held here (peer API)."""
        return _held(job, role, step).meta()

    @app.get(
        "/v1/state/{job}/{role}/{step}/shard", dependencies=needs_token, response_class=Response,
        responses={200: _BYTES_REPLY, **_errors(401, 404, 409, 416, 422, 503)},
    )
    async def shard(job: JobName, role: RoleName, step: Step, offset: Offset = 0, length: Annotated[int | None, Query(ge=0, le=MAX_INT64)] = None) -> Response:
        """The raw bytes of a shard held here, or ``length`` of them from ``offset`` (peer API)."""
        held = _held(job, role, step)
        end = held.nbytes if length is None else offset + length
        if not 0 <= offset <= end <= held.nbytes:
            raise HTTPException(416, f"range {offset}..{end} is outside the shard's {held.nbytes} bytes")
        data = await asyncio.to_thread(bytes, held.view()[offset:end])
        # A save reusing this slot first drops the version (on this event loop); if the version
        # is still there after the copy, no byte of it changed meanwhile.
        if not held.current():
            raise HTTPException(409, f"step {step} of {role} was replaced while being read; ask again")
        return Response(data, media_type="application/octet-stream", headers={"X-FFplane-Checksum": held.checksum})

    def _replica_begin(job: str, role: str, step: int, meta: Any) -> int:
        """Start (or resume) receiving a replica described by ``meta``; the offset to send from."""
        assert daemon.state is not None
        try:
            m = ReplicaMeta.model_validate(meta)
            args = (check_name(job), check_name(role), check_step(step), m.nbytes, m.checksum, m.header, m.source)
        except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
            raise HTTPException(422, f"replica metadata needs nbytes, checksum, header and source: {' '.join(str(exc).split())}") from exc
        if m.nbytes > daemon.config.budget_bytes:  # could never fit, whatever leaves: say so
            raise HTTPException(
                413, f"a replica of {m.nbytes / 2**20:.1f} MiB is larger than this daemon's whole budget "
                f"({daemon.config.budget_bytes / 2**20:.1f} MiB); raise --budget-mb on this node",
            )
        try:
            return daemon.state.replicas.begin(*args)
        except SlotError as exc:
            raise _peer_error(exc) from exc

    @app.post(
        "/v1/replicas/{job}/{role}/{step}/begin", dependencies=needs_token, response_model=Received,
        responses=_errors(401, 413, 422, 503), openapi_extra=_JSON_BODY,
    )
    async def replica_begin(job: JobName, role: RoleName, step: Step, request: Request) -> dict[str, Any]:
        """Start or resume receiving a replica; answers the offset to send from (peer API)."""
        assert daemon.state is not None
        _bounded_body(request, META_LIMIT)
        body = bytearray()
        async for piece in request.stream():  # no Content-Length (chunked): counted as it comes
            body += piece
            if len(body) > META_LIMIT:
                raise HTTPException(413, f"replica metadata over {META_LIMIT} bytes")
        try:
            meta = ReplicaMeta.model_validate_json(bytes(body))
        except ValueError as exc:
            raise HTTPException(422, f"replica begin needs a JSON body with nbytes, checksum, header and source: {' '.join(str(exc).split())}") from exc
        return {"received": _replica_begin(job, role, step, meta)}

    @app.put(
        "/v1/replicas/{job}/{role}/{step}", dependencies=needs_token, response_model=Received,
        responses=_errors(400, 401, 409, 413, 422, 503), openapi_extra=_BYTES_BODY,
    )
    async def replica_chunk(job: JobName, role: RoleName, step: Step, offset: Offset, request: Request) -> dict[str, Any]:
        """The replica's bytes from ``offset`` on, streamed; a cut-off transfer resumes where the
        answer of the next ``begin`` says (peer API)."""
        assert daemon.state is not None
        _bounded_body(request, daemon.config.budget_bytes)
        try:
            return {"received": await daemon.state.replicas.receive(job, role, step, offset, request.stream())}
        except SlotError as exc:
            raise _peer_error(exc) from exc

    @app.put(
        "/v1/replicas/{job}/{role}/{step}/whole", dependencies=needs_token, response_model=WholeReceived,
        responses=_errors(400, 401, 409, 413, 422, 503), openapi_extra=_BYTES_BODY,
    )
    async def replica_whole(job: JobName, role: RoleName, step: Step, request: Request, newest: Newest = None) -> dict[str, Any]:
        """A whole replica in one request: the body is its metadata (a little-endian u32 length,
        then the JSON ``begin`` takes) followed by every byte; received, verified and committed.
        A receiver already holding part of it answers 409: resume through ``begin`` (peer API)."""
        assert daemon.state is not None
        replicas = daemon.state.replicas
        _bounded_body(request, daemon.config.budget_bytes + 4 + META_LIMIT)
        try:
            meta, rest = await read_meta_prefix(request.stream(), META_LIMIT)
        except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
            raise HTTPException(422, f"a whole replica starts with its metadata (u32 length, then JSON): {exc}") from exc
        offset = _replica_begin(job, role, step, meta)
        if offset:
            async for _ in rest:  # read to the end, so the connection stays usable
                pass
            raise HTTPException(409, f"{offset} bytes of {role} step {step} are here already; resume through begin")
        try:
            received = await replicas.receive(job, role, step, 0, rest)
            r = await replicas.finish(job, role, step, newest)
        except SlotError as exc:
            raise _peer_error(exc) from exc
        return {"received": received, "checksum": r.checksum}

    @app.post("/v1/replicas/{job}/{role}/{step}/commit", dependencies=needs_token, response_model=Committed, responses=_errors(401, 409, 422, 503))
    async def replica_commit(job: JobName, role: RoleName, step: Step, newest: Newest = None) -> dict[str, Any]:
        """Verify the whole replica's checksum and make it count; ``newest`` is the sender's newest
        committed step of the role (replicas above it are dropped) (peer API)."""
        assert daemon.state is not None
        try:
            r = await daemon.state.replicas.finish(job, role, step, newest)
        except SlotError as exc:
            raise _peer_error(exc) from exc
        return {"ok": True, "checksum": r.checksum}

    @app.get("/v1/gate")
    async def gate() -> dict[str, Any]:  # on the loop: the gate's hint maps are the loop's
        """The link gate: open or why closed, STATE bytes sent through it by priority, time paused."""
        assert daemon.gate is not None
        return daemon.gate.describe()

    registry = None

    @app.get("/metrics", response_class=Response, responses={200: {"description": "Prometheus text exposition", "content": {"text/plain": {"schema": {"type": "string"}}}}})
    def metrics() -> Response:
        nonlocal registry
        assert daemon.cache is not None and daemon.state is not None
        registry = registry or registry_for(daemon.cache, daemon.state.slots, daemon.gate, daemon.state)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
