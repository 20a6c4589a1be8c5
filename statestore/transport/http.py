"""The HTTP transport: both halves of shard moves over the daemons' HTTP API — the client
(``HttpTransport``) and the peer routes every daemon serves (``peer_routes``).

Both directions move chunks of ``GateConfig.chunk_bytes`` through the node's link gate, with the
job's token: pushes to ``/v1/replicas/...``, reads from ``/v1/state/...``. A shard's first push is
one request (metadata, bytes, commit: ``PUT .../whole``, body as ``_body`` lays it out); a retry
resumes at the offset the receiver reports (``begin``, then ``PUT`` from there and ``commit``), so
an interrupted transfer does not start over; the receiver verifies the whole-shard checksum before
the replica counts.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

import aiohttp
from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response
from fastapi import Path as PathParam
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ffplane_contract.auth import bearer
from ffplane_contract.errors import CorruptError, FFPlaneError, TransferOrderError
from ffplane_contract.limits import MAX_BYTES, MAX_STEP, NAME_PATTERN, check_name, check_step
from ffplane_contract.shard import META_LIMIT, check_header, header_intact
from ffplane_runtime.httpserver import BearerAuth
from statestore.link_gate import LinkGate, Priority
from statestore.replicas import Replica, ReplicaStore
from statestore.shard import LocalShard, find_local
from statestore.slots import SlotStore
from statestore.transport._body import meta_prefix, read_meta_prefix
from statestore.transport._sockets import push_socket_options
from statestore.transport.base import PeerError, RemoteShard, Transport

__all__ = ["HttpTransport", "meta_prefix", "peer_routes", "read_meta_prefix", "remember"]

_KEPT = 4096


def remember(kept: set[Any], item: Any) -> None:
    """Add ``item`` to a bounded memory of what went before: past ``_KEPT`` it starts afresh
    (forgetting only ever costs a retry the first-attempt path)."""
    if len(kept) > _KEPT:
        kept.clear()
    kept.add(item)


class HttpTransport(Transport):
    """The client: chunked reads from, and chunked pushes to, another daemon's peer routes."""

    def __init__(self, gate: LinkGate, token: str | None) -> None:
        super().__init__()
        self._gate = gate
        self._headers = bearer(token)
        self._session: aiohttp.ClientSession | None = None
        self._push_session: aiohttp.ClientSession | None = None  # bounded send queue, for pushes
        self._tried: set[tuple[str, str, str, int]] = set()  # shards whose single-request push did not complete

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=3, sock_read=30)
        self._session = aiohttp.ClientSession(timeout=timeout)
        lowat = self._gate.config.chunk_bytes

        def small_queue(info: Any) -> socket.socket:
            sock = socket.socket(family=info[0], type=info[1], proto=info[2])
            push_socket_options(sock, lowat)
            return sock

        self._push_session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(socket_factory=small_queue))

    async def close(self) -> None:
        for session in (self._session, self._push_session):
            if session is not None:
                await session.close()

    async def _json(self, method: str, url: str, session: aiohttp.ClientSession | None = None, **kw: Any) -> dict[str, Any]:
        session = session or self._session
        assert session is not None
        try:
            async with session.request(method, url, headers=self._headers, **kw) as resp:
                if resp.status != 200:
                    raise PeerError(f"{method} {url} answered {resp.status}: {(await resp.text())[:300]}", resp.status)
                result: dict[str, Any] = await resp.json()
                return result
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise PeerError(
                f"{method} {url} failed: {exc!r}", unreachable=isinstance(exc, (aiohttp.ClientConnectorError, asyncio.TimeoutError))
            ) from exc

    async def push(
        self,
        base: str,
        shard: LocalShard,
        source: str,
        newest: int | None,
        urgent: Callable[[], bool] = lambda: False,
        maybe_there: bool = False,
    ) -> int:
        """A shard's first attempt is one request carrying its metadata, its bytes and the commit
        (``PUT .../whole``): three requests per shard per step were most of a daemon's HTTP
        work in a job with short steps. A retry, a receiver that already holds part of the
        shard, or one that ``maybe_there`` (a version pushed before, sent again after a ring
        change) goes through ``begin`` and resumes from the offset it answers — nothing more
        if the whole shard is there.
        """
        assert self._session is not None
        url = f"{base}/v1/replicas/{shard.job}/{shard.role}/{shard.step}"
        meta = {
            "nbytes": shard.nbytes,
            "checksum": shard.checksum,
            "header": shard.header,
            "source": source,
            "header_digest": shard.header_digest,
        }
        attempt = (base, shard.job, shard.role, shard.step)
        staged: memoryview | None = None
        start: int | None = None  # what the receiver holds; not asked before a first attempt
        if attempt in self._tried or maybe_there:
            start = await self._begin(url, meta)  # asked before staging: it may hold all of it
        else:
            staged = await self._staged(shard)
            remember(self._tried, attempt)
            try:
                await self._json(
                    "PUT",
                    f"{url}/whole",
                    params={} if newest is None else {"newest": str(newest)},
                    session=self._push_session,
                    data=self._gated(staged, 0, urgent, prefix=meta_prefix(meta)),
                )
            except PeerError as exc:
                if not exc.conflict:
                    raise  # retried later through begin, from what arrived
                start = await self._begin(url, meta)  # 409: the receiver holds part of it already
            else:
                self._tried.discard(attempt)
                self.counts.in_one_request += 1
                return shard.nbytes
        if start == shard.nbytes:  # complete and verified there: its commit has been made
            self._tried.discard(attempt)
            self.counts.already_there += 1
            return 0
        if staged is None:
            staged = await self._staged(shard)
        offset = int(
            (
                await self._json(
                    "PUT", url, params={"offset": str(start)}, session=self._push_session, data=self._gated(staged, start, urgent)
                )
            )["received"]
        )
        if offset != shard.nbytes:
            raise PeerError(f"{shard.role} step {shard.step}: the receiver has {offset} of {shard.nbytes} bytes; will resume", 502)
        await self._json("POST", f"{url}/commit", params={} if newest is None else {"newest": str(newest)})
        self._tried.discard(attempt)
        self.counts.resumed += 1
        return offset - start

    async def _begin(self, url: str, meta: dict[str, Any]) -> int:
        """Announce a shard to the receiver; the offset it holds it up to."""
        return int((await self._json("POST", f"{url}/begin", json=meta))["received"])

    @staticmethod
    async def _staged(shard: LocalShard) -> memoryview:
        """A private copy of ``shard`` (memcpy speed): a save may reuse the slot two commits
        later, long before a slow link has carried the whole shard; the copy keeps every pushed
        byte useful and saves never wait for the network."""
        staged = memoryview(await asyncio.to_thread(bytes, shard.view()))
        if not shard.current():
            raise PeerError(f"{shard.role} step {shard.step} was replaced here while being staged", 409)
        return staged

    async def _gated(
        self, view: memoryview, start: int, urgent: Callable[[], bool], prefix: bytes = b""
    ) -> AsyncIterator[memoryview | bytes]:
        """One request's body, fed a chunk at a time as the gate allows; the connection's small
        unsent-bytes limit keeps what is queued when TRAIN starts to about one chunk."""
        if prefix:
            yield prefix
        chunk = self._gate.config.chunk_bytes
        pos = start
        while pos < len(view):
            n = min(chunk, len(view) - pos)
            await self._gate.acquire(Priority.REPLICATE, n, critical=urgent)
            yield view[pos : pos + n]
            pos += n

    async def shard_meta(self, base: str, job: str, role: str, step: int) -> RemoteShard:
        meta = await self._json("GET", f"{base}/v1/state/{job}/{role}/{step}")
        return RemoteShard(
            int(meta["nbytes"]), str(meta["checksum"]), dict(meta["header"]), str(meta.get("kind", "")), str(meta.get("header_digest", ""))
        )

    async def pull(self, base: str, replicas: ReplicaStore, job: str, role: str, step: int, source: str) -> Replica:
        assert self._session is not None
        url = f"{base}/v1/state/{job}/{role}/{step}"
        held = await self.shard_meta(base, job, role, step)
        nbytes, digest, header = held.nbytes, held.checksum, held.header
        if not header_intact(header, held.header_digest):  # the holder's header changed at rest: not a copy to restore from
            raise PeerError(f"{role} step {step} on {base} has a header that does not match its digest", CorruptError.status)
        offset = replicas.begin(job, role, step, nbytes, digest, header, source, kind="pulled", header_digest=held.header_digest)
        chunk = self._gate.config.chunk_bytes
        conflicts = 0
        while offset < nbytes:
            n = min(chunk, nbytes - offset)
            await self._gate.acquire(Priority.NEXT_BATCH, n)  # a worker is waiting for it
            try:
                async with self._session.get(
                    f"{url}/shard", params={"offset": str(offset), "length": str(n)}, headers=self._headers
                ) as resp:
                    if resp.status != 200:
                        raise PeerError(f"GET {url}/shard answered {resp.status}: {(await resp.text())[:300]}", resp.status)
                    data = await resp.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise PeerError(f"GET {url}/shard failed: {exc!r}") from exc
            try:
                offset = await replicas.write(job, role, step, offset, data)
            except FFPlaneError as exc:
                conflicts += 1
                if not isinstance(exc, TransferOrderError) or conflicts > 16:
                    raise
                # The holder is also pushing this shard here (it is our ring predecessor and
                # re-replicates after the failure): both write one transfer, in order, so carry
                # on from wherever it has got to (all of it, once the push has finished).
                offset = replicas.begin(job, role, step, nbytes, digest, header, source, kind="pulled", header_digest=held.header_digest)
        return await replicas.finish(job, role, step)


# --- the server: the peer routes, their parameters and answers (the OpenAPI spec is fuzzed) ------


JobName = Annotated[str, PathParam(pattern=NAME_PATTERN, description="the job's name")]
RoleName = Annotated[str, PathParam(pattern=NAME_PATTERN, description="a role: dp<r>-pp<r>-tp<r>")]
Step = Annotated[int, PathParam(ge=0, le=MAX_STEP, description="the optimizer step the shard was saved at")]
Offset = Annotated[int, Query(ge=0, le=MAX_BYTES, description="byte offset in the shard")]
Newest = Annotated[int | None, Query(ge=0, le=MAX_STEP, description="the sender's newest committed step of the role")]


class ErrorDetail(BaseModel):
    detail: str


class ValidationDetail(BaseModel):
    """422: a sentence from the daemon, or FastAPI's list of the parameters that failed validation."""

    detail: str | list[dict[str, Any]]


class ReplicaMeta(BaseModel):
    """What a replica push announces (``begin``'s body, the head of ``whole``'s). Strict: a
    ``false`` is not a size of 0 bytes."""

    model_config = ConfigDict(strict=True)

    nbytes: int = Field(ge=0, le=MAX_BYTES)
    checksum: str = Field(min_length=1, max_length=128)
    header: dict[str, Any]
    source: str = Field(max_length=256)
    header_digest: str = Field(default="", max_length=128)  # of the whole header; the receiver checks it with the checksum

    @field_validator("header")
    @classmethod
    def _typed(cls, header: dict[str, Any]) -> dict[str, Any]:
        check_header(header)  # a field of the wrong type is refused here, not at a restore
        return header


class Received(BaseModel):
    received: int


class Transfer(BaseModel):
    bulk_port: int | None


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


def _peer_error(exc: FFPlaneError) -> HTTPException:
    """A state error as a peer API answer. No room *now* (507 on the control socket, where a
    local save turns it into CapacityError) is a 413 here: the request is more than this daemon
    is able to take at the moment, the sender retries later, and no fault of the server is
    reported as a 5xx."""
    return HTTPException(413 if exc.status == 507 else exc.status, str(exc))


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {c: {"model": ValidationDetail if c == 422 else ErrorDetail, "description": _WHY[c]} for c in codes}


_BINARY = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
_BYTES_BODY: dict[str, Any] = {"requestBody": {"required": True, "content": _BINARY}}
_JSON_BODY: dict[str, Any] = {
    "requestBody": {"required": True, "content": {"application/json": {"schema": ReplicaMeta.model_json_schema()}}}
}
_BYTES_REPLY: dict[str, Any] = {
    "description": "the shard's bytes",
    "content": _BINARY,
    "headers": {"X-FFplane-Checksum": {"description": "XXH3-64 of the whole shard", "schema": {"type": "string"}}},
}


def _bounded_body(request: Request, limit: int) -> None:
    """413 before a byte is read when the declared body is larger than anything this route keeps."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, f"a body of {declared} bytes; at most {limit} fit here (the daemon's --budget-mb bounds a replica)")


def peer_routes(
    token: str | None, slots: SlotStore, replicas: ReplicaStore, budget_bytes: int, bulk_port: Callable[[], int | None] = lambda: None
) -> APIRouter:
    """The routes other daemons' ``HttpTransport`` calls: reads of the shards held here (from
    ``slots`` and ``replicas``), and replicas received into ``replicas``. Every one needs
    ``token``; ``budget_bytes`` (the daemon's whole budget) bounds what a replica may announce;
    ``bulk_port``: where this daemon takes pushes on the bulk channel (None: it does not)."""
    router = APIRouter()
    needs_token = [Depends(BearerAuth(token))]

    def peer(*codes: int, **more: Any) -> dict[str, Any]:
        """What every peer route declares: the token, and the error statuses it answers."""
        return {"dependencies": needs_token, "responses": _errors(*codes), **more}

    @router.get("/v1/transfer", **peer(401, 503, response_model=Transfer))
    def transfer() -> dict[str, Any]:
        """How replicas may be pushed here: the bulk channel's TCP port, on this daemon's host
        (null: over the HTTP routes only) (peer API)."""
        return {"bulk_port": bulk_port()}

    def _held(job: str, role: str, step: int) -> LocalShard:
        shard = find_local(slots, replicas, job, role, step)
        if shard is None:
            raise HTTPException(404, f"no committed shard or replica of {role} at step {step} in job {job!r} on this node")
        return shard

    @router.get("/v1/state/{job}/{role}/{step}", **peer(401, 404, 422, 503))
    def shard_meta(job: JobName, role: RoleName, step: Step) -> dict[str, Any]:
        """Size, checksum and header of a shard held here (peer API)."""
        return _held(job, role, step).meta()

    @router.get(
        "/v1/state/{job}/{role}/{step}/shard",
        dependencies=needs_token,
        response_class=Response,
        responses={200: _BYTES_REPLY, **_errors(401, 404, 409, 416, 422, 503)},
    )
    async def shard(
        job: JobName, role: RoleName, step: Step, offset: Offset = 0, length: Annotated[int | None, Query(ge=0, le=MAX_BYTES)] = None
    ) -> Response:
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
        try:
            m = ReplicaMeta.model_validate(meta)
            args = (check_name(job), check_name(role), check_step(step), m.nbytes, m.checksum, m.header, m.source)
        except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
            raise HTTPException(422, f"replica metadata needs nbytes, checksum, header and source: {' '.join(str(exc).split())}") from exc
        if m.nbytes > budget_bytes:  # could never fit, whatever leaves: say so
            raise HTTPException(
                413,
                f"a replica of {m.nbytes / 2**20:.1f} MiB is larger than this daemon's whole budget "
                f"({budget_bytes / 2**20:.1f} MiB); raise --budget-mb on this node",
            )
        try:
            return replicas.begin(*args, header_digest=m.header_digest)
        except FFPlaneError as exc:
            raise _peer_error(exc) from exc

    @router.post("/v1/replicas/{job}/{role}/{step}/begin", **peer(401, 413, 422, 503, response_model=Received, openapi_extra=_JSON_BODY))
    async def replica_begin(job: JobName, role: RoleName, step: Step, request: Request) -> dict[str, Any]:
        """Start or resume receiving a replica; answers the offset to send from (peer API)."""
        _bounded_body(request, META_LIMIT)
        body = bytearray()
        async for piece in request.stream():  # no Content-Length (chunked): counted as it comes
            body += piece
            if len(body) > META_LIMIT:
                raise HTTPException(413, f"replica metadata over {META_LIMIT} bytes")
        try:
            meta = ReplicaMeta.model_validate_json(bytes(body))
        except ValueError as exc:
            raise HTTPException(
                422, f"replica begin needs a JSON body with nbytes, checksum, header and source: {' '.join(str(exc).split())}"
            ) from exc
        return {"received": _replica_begin(job, role, step, meta)}

    @router.put(
        "/v1/replicas/{job}/{role}/{step}", **peer(400, 401, 409, 413, 422, 503, response_model=Received, openapi_extra=_BYTES_BODY)
    )
    async def replica_chunk(job: JobName, role: RoleName, step: Step, offset: Offset, request: Request) -> dict[str, Any]:
        """The replica's bytes from ``offset`` on, streamed; a cut-off transfer resumes where the
        answer of the next ``begin`` says (peer API)."""
        _bounded_body(request, budget_bytes)
        try:
            return {"received": await replicas.receive(job, role, step, offset, request.stream())}
        except FFPlaneError as exc:
            raise _peer_error(exc) from exc

    @router.put(
        "/v1/replicas/{job}/{role}/{step}/whole",
        **peer(400, 401, 409, 413, 422, 503, response_model=WholeReceived, openapi_extra=_BYTES_BODY),
    )
    async def replica_whole(job: JobName, role: RoleName, step: Step, request: Request, newest: Newest = None) -> dict[str, Any]:
        """A whole replica in one request: the body is its metadata (a little-endian u32 length,
        then the JSON ``begin`` takes) followed by every byte; received, verified and committed.
        A receiver already holding part of it answers 409: resume through ``begin`` (peer API)."""
        _bounded_body(request, budget_bytes + 4 + META_LIMIT)
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
        except FFPlaneError as exc:
            raise _peer_error(exc) from exc
        return {"received": received, "checksum": r.checksum}

    @router.post("/v1/replicas/{job}/{role}/{step}/commit", **peer(401, 409, 422, 503, response_model=Committed))
    async def replica_commit(job: JobName, role: RoleName, step: Step, newest: Newest = None) -> dict[str, Any]:
        """Verify the whole replica's checksum and make it count; ``newest`` is the sender's newest
        committed step of the role (replicas above it are dropped) (peer API)."""
        try:
            r = await replicas.finish(job, role, step, newest)
        except FFPlaneError as exc:
            raise _peer_error(exc) from exc
        return {"ok": True, "checksum": r.checksum}

    return router
