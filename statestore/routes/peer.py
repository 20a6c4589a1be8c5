"""The peer API: the routes other daemons' ``HttpTransport`` calls. Reads of the shards held
here (from the slots and the replicas), and replicas received into the replicas. Every one needs
the job's token; the daemon's whole budget bounds what a replica may announce.

A shard's first push is one request (``PUT .../whole``: metadata, bytes, commit); a retry resumes
at the offset ``begin`` answers (then ``PUT`` from there and ``commit``), and the receiver verifies
the whole-shard checksum before the replica counts.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from ffplane_contract.daemon_http import (
    Committed,
    JobName,
    Length,
    Newest,
    Offset,
    Received,
    ReplicaMeta,
    RoleName,
    Step,
    Transfer,
    WholeReceived,
)
from ffplane_contract.errors import CapacityError, ConflictError, InvalidError, NotFoundError, TransferOrderError
from ffplane_contract.limits import check_name, check_step
from ffplane_contract.shard import META_LIMIT
from statestore.daemon import Node
from statestore.routes._errors import documented
from statestore.routes._node import NodeDep, authorised
from statestore.shard import LocalShard
from statestore.transport import read_meta_prefix

__all__ = ["router"]

router = APIRouter(dependencies=[Depends(authorised)])

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


@router.get("/v1/transfer", response_model=Transfer, responses=documented(401, 503))
def transfer(node: NodeDep) -> dict[str, Any]:
    """How replicas may be pushed here: the bulk channel's TCP port, on this daemon's host
    (null: over the HTTP routes only) (peer API)."""
    return {"bulk_port": node.bulk.port if node.bulk else None}


@router.get("/v1/state/{job}/{role}/{step}", responses=documented(401, 404, 422, 503))
async def shard_meta(job: JobName, role: RoleName, step: Step, node: NodeDep) -> dict[str, Any]:
    """Size, checksum and header of a shard held here, or rebuilt here from parity (peer API)."""
    return (await _held(node, job, role, step)).meta()


@router.get(
    "/v1/state/{job}/{role}/{step}/shard",
    response_class=Response,
    responses={200: _BYTES_REPLY, **documented(401, 404, 409, 416, 422, 503)},
)
async def shard(job: JobName, role: RoleName, step: Step, node: NodeDep, offset: Offset = 0, length: Length = None) -> Response:
    """The raw bytes of a shard held here, or ``length`` of them from ``offset`` (peer API)."""
    held = await _held(node, job, role, step)
    end = held.nbytes if length is None else offset + length
    if not 0 <= offset <= end <= held.nbytes:
        raise NotFoundError(f"range {offset}..{end} is outside the shard's {held.nbytes} bytes", 416)
    data = await asyncio.to_thread(bytes, held.view()[offset:end])
    # A save reusing this slot first drops the version (on this event loop); if the version
    # is still there after the copy, no byte of it changed meanwhile.
    if not held.current():
        raise ConflictError(f"step {step} of {role} was replaced while being read; ask again")
    return Response(data, media_type="application/octet-stream", headers={"X-FFplane-Checksum": held.checksum})


@router.post(
    "/v1/replicas/{job}/{role}/{step}/begin",
    response_model=Received,
    responses=documented(401, 413, 422, 503),
    openapi_extra=_JSON_BODY,
)
async def replica_begin(job: JobName, role: RoleName, step: Step, request: Request, node: NodeDep) -> dict[str, Any]:
    """Start or resume receiving a replica; answers the offset to send from (peer API)."""
    _bounded_body(request, META_LIMIT)
    body = bytearray()
    async for piece in request.stream():  # no Content-Length (chunked): counted as it comes
        body += piece
        if len(body) > META_LIMIT:
            raise CapacityError(f"replica metadata over {META_LIMIT} bytes")
    try:
        meta = ReplicaMeta.model_validate_json(bytes(body))
    except ValueError as exc:
        raise InvalidError(
            f"replica begin needs a JSON body with nbytes, checksum, header and source: {' '.join(str(exc).split())}"
        ) from exc
    return {"received": _begin(node, job, role, step, meta)}


@router.put(
    "/v1/replicas/{job}/{role}/{step}",
    response_model=Received,
    responses=documented(400, 401, 409, 413, 422, 503),
    openapi_extra=_BYTES_BODY,
)
async def replica_chunk(job: JobName, role: RoleName, step: Step, offset: Offset, request: Request, node: NodeDep) -> dict[str, Any]:
    """The replica's bytes from ``offset`` on, streamed; a cut-off transfer resumes where the
    answer of the next ``begin`` says (peer API)."""
    _bounded_body(request, node.root.budget.total)
    return {"received": await node.root.replicas.receive(job, role, step, offset, request.stream())}


@router.put(
    "/v1/replicas/{job}/{role}/{step}/whole",
    response_model=WholeReceived,
    responses=documented(400, 401, 409, 413, 422, 503),
    openapi_extra=_BYTES_BODY,
)
async def replica_whole(job: JobName, role: RoleName, step: Step, request: Request, node: NodeDep, newest: Newest = None) -> dict[str, Any]:
    """A whole replica in one request: the body is its metadata (a little-endian u32 length,
    then the JSON ``begin`` takes) followed by every byte; received, verified and committed.
    A receiver already holding part of it answers 409: resume through ``begin`` (peer API)."""
    _bounded_body(request, node.root.budget.total + 4 + META_LIMIT)
    try:
        meta, rest = await read_meta_prefix(request.stream(), META_LIMIT)
    except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
        raise InvalidError(f"a whole replica starts with its metadata (u32 length, then JSON): {exc}") from exc
    offset = _begin(node, job, role, step, meta)
    if offset:
        async for _ in rest:  # read to the end, so the connection stays usable
            pass
        raise TransferOrderError(f"{offset} bytes of {role} step {step} are here already; resume through begin")
    replicas = node.root.replicas
    received = await replicas.receive(job, role, step, 0, rest)
    r = await replicas.finish(job, role, step, newest)
    return {"received": received, "checksum": r.checksum}


@router.post("/v1/replicas/{job}/{role}/{step}/commit", response_model=Committed, responses=documented(401, 409, 422, 503))
async def replica_commit(job: JobName, role: RoleName, step: Step, node: NodeDep, newest: Newest = None) -> dict[str, Any]:
    """Verify the whole replica's checksum and make it count; ``newest`` is the sender's newest
    committed step of the role (replicas above it are dropped) (peer API)."""
    r = await node.root.replicas.finish(job, role, step, newest)
    return {"ok": True, "checksum": r.checksum}


async def _held(node: Node, job: str, role: str, step: int) -> LocalShard:
    shard = await node.state.held(job, role, step)
    if shard is None:
        raise NotFoundError(f"no committed shard or replica of {role} at step {step} in job {job!r} on this node")
    return shard


def _begin(node: Node, job: str, role: str, step: int, meta: Any) -> int:
    """Start (or resume) receiving a replica described by ``meta``; the offset to send from."""
    try:
        m = ReplicaMeta.model_validate(meta)
        args = (check_name(job), check_name(role), check_step(step), m.nbytes, m.checksum, m.header, m.source)
    except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
        raise InvalidError(f"replica metadata needs nbytes, checksum, header and source: {' '.join(str(exc).split())}") from exc
    total = node.root.budget.total
    if m.nbytes > total:  # could never fit, whatever leaves: say so
        raise CapacityError(
            f"a replica of {m.nbytes / 2**20:.1f} MiB is larger than this daemon's whole budget "
            f"({total / 2**20:.1f} MiB); raise --budget-mb on this node",
        )
    return node.root.replicas.begin(*args, header_digest=m.header_digest)


def _bounded_body(request: Request, limit: int) -> None:
    """413 before a byte is read when the declared body is larger than anything this route keeps."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise CapacityError(f"a body of {declared} bytes; at most {limit} fit here (the daemon's --budget-mb bounds a replica)")
