"""The coordinator's routes: node heartbeats and reports, the ring view, membership, a job's
restore status, the whole cluster for the status page, and which server coordinates.

They are async: they run on the event loop, one at a time, so membership needs no lock (sync
routes would run concurrently in the thread pool) and skip a thread hop. All but ``/v1/leader``
are answered by the server that coordinates only (``LEADER_ONLY``); the others answer 421 naming it.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response

from dataserver.cluster_view import cluster_view
from dataserver.http_errors import NOT_JSON, TOO_LARGE, documented
from dataserver.routes._common import LEADER_ONLY, SECURED, TOKEN, NodeIdPath, PathName, Server
from ffplane_contract.dataserver_http import HeartbeatBody, RingView, UnreachableAnswer, UnreachableReport
from ffplane_contract.errors import (
    CapacityError,
    ConflictError,
    InvalidError,
    NotCoordinatorError,
    NotFoundError,
    UnauthorisedError,
    UnavailableError,
)
from ffplane_contract.limits import NAME_LEN

log = logging.getLogger(__name__)
router = APIRouter()


@router.post(
    "/v1/nodes/heartbeat",
    dependencies=[*TOKEN, *LEADER_ONLY],
    response_class=Response,
    responses={
        200: {"model": RingView},
        **documented(
            UnauthorisedError,
            ConflictError,
            (CapacityError, TOO_LARGE),
            NotCoordinatorError,
            InvalidError,
            UnavailableError,
            (InvalidError, NOT_JSON),
        ),
    },
    openapi_extra=SECURED,
)
async def heartbeat(body: HeartbeatBody, request: Request, server: Server) -> Response:
    """A node daemon's full heartbeat: registers it, records its shard inventory and workers.
    Answers the ring view (ring, members' addresses, dead nodes, this node's successor) and
    the UDP port for its next beats. A record (one job's version, role or job, one worker)
    that fails its check is left out and the rest taken; the answer's ``dropped`` names it."""
    coordinator = server.coordination.coordinator
    udp = body.udp.model_dump() if body.udp is not None else None
    client = request.client.host if request.client is not None else None
    drops = coordinator.heartbeat(
        body.node_id, body.address, body.budget_bytes, body.inventory, body.workers, body.exited, udp, client_host=client
    )
    server.coordination.check_settled()  # recorded, but no view yet from a server that just took over
    view = coordinator.view_bytes(body.node_id)
    if drops.count:
        view = view[:-1] + b"," + json.dumps(drops.answer(), separators=(",", ":")).encode()[1:]
    return Response(view, media_type="application/json")


@router.post(
    "/v1/nodes/{node_id}/unreachable",
    dependencies=[*TOKEN, *LEADER_ONLY],
    responses=documented(
        UnauthorisedError, NotFoundError, (CapacityError, TOO_LARGE), NotCoordinatorError, InvalidError, (InvalidError, NOT_JSON)
    ),
    openapi_extra=SECURED,
)
async def unreachable(node_id: NodeIdPath, body: UnreachableReport, server: Server) -> UnreachableAnswer:
    """A daemon reports that its ring successor ``node_id`` beats but takes no connection. The
    coordinator checks for itself: if the node does not answer it either, it leaves the ring
    (its predecessor replicates past it) until a later check finds it answering."""
    coordinator = server.coordination.coordinator
    m = coordinator.members.get(node_id)
    if m is None or not m.alive:
        raise NotFoundError(f"node {node_id!r} is not a live member; nothing to do")
    if m.unreachable:
        return UnreachableAnswer(node_id=node_id, unreachable=True, detail="out of the ring already")
    if await server.coordination.probe(m.address):
        return UnreachableAnswer(
            node_id=node_id, unreachable=False, detail=f"{m.address} answers the coordinator; the reporter's own link may be at fault"
        )
    coordinator.set_unreachable(node_id, True)
    log.warning("node reported unreachable and confirmed", extra={"node": node_id, "reporter": body.reporter, "address": m.address})
    return UnreachableAnswer(node_id=node_id, unreachable=True, detail=f"{m.address} does not answer; out of the ring until it does")


@router.get(
    "/v1/nodes/view",
    response_class=Response,
    responses={200: {"model": RingView}, **documented(NotCoordinatorError, InvalidError, UnavailableError)},
    dependencies=LEADER_ONLY,
)
async def nodes_view(server: Server, node_id: Annotated[str | None, Query(max_length=NAME_LEN)] = None) -> Response:
    """The ring view, as answered to heartbeats (with ``node_id``: that node's successor)."""
    server.coordination.check_settled()
    return Response(server.coordination.coordinator.view_bytes(node_id), media_type="application/json")


@router.get("/v1/nodes", responses=documented(NotCoordinatorError), dependencies=LEADER_ONLY)
async def nodes(server: Server) -> dict[str, Any]:
    coordinator = server.coordination.coordinator
    return {
        "ring": coordinator.ring(),
        "members": {n: {"address": m.address, "alive": m.alive, "unreachable": m.unreachable} for n, m in coordinator.members.items()},
        "udp_port": coordinator.udp_port,
        "stats": coordinator.stats,
    }


@router.get("/v1/nodes/{node_id}", responses=documented(NotFoundError, NotCoordinatorError, InvalidError), dependencies=LEADER_ONLY)
async def node(node_id: NodeIdPath, server: Server) -> dict[str, Any]:
    m = server.coordination.coordinator.members.get(node_id)
    if m is None:
        raise NotFoundError(f"unknown node {node_id!r}; it has never sent a heartbeat (or was dead long enough to be forgotten)")
    return {
        "node_id": node_id,
        "address": m.address,
        "alive": m.alive,
        "silent_s": round(time.monotonic() - m.last_seen, 3),
        "http_beats": m.http_beats,
        "udp_beats": m.udp_beats,
    }


@router.get("/v1/jobs/{name}/status", responses=documented(NotCoordinatorError, InvalidError, UnavailableError), dependencies=LEADER_ONLY)
async def job_status(name: PathName, server: Server) -> dict[str, Any]:
    """Members, ring, dead nodes, restorable step and per-role shard locations of a job, and
    the newest step any daemon ever reported committed (``committed_step``, kept across
    restarts of this server): a restore that finds nothing although it is set must fail."""
    server.coordination.check_settled()
    coordinator, jobs = server.coordination.coordinator, server.jobs
    status = coordinator.status(name)
    newest = coordinator.newest_step(name)
    job = await server.registry(jobs.find, name)
    if job is not None:
        await server.registry(jobs.note_committed, job, newest)
    status["committed_step"] = job.committed_step if job is not None else newest
    return status


@router.get("/v1/cluster", responses=documented(NotCoordinatorError, UnavailableError), dependencies=LEADER_ONLY)
async def cluster(server: Server) -> dict[str, Any]:
    """Nodes, ring, each live daemon's roles, replicas, cache and gate, each job's restorable
    step and shard locations, recent failures and their recovery (the status page's data)."""
    server.coordination.check_settled()
    names = await server.registry(server.jobs.names)
    return await cluster_view(server.coordination.coordinator, names, server.coordination.url)


@router.get("/v1/leader")
async def leader(server: Server) -> dict[str, Any]:
    """Whether this server coordinates, and which one does (with several data servers)."""
    coordination = server.coordination
    return {"url": coordination.url, "leading": coordination.leading, "leader": coordination.leader}
