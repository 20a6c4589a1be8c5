"""The ops API: liveness and readiness, what the node caches and holds, its link gate, and its
Prometheus metrics. Read-only, and open without the token (nothing in it is a job's data)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ffplane_contract.errors import UnavailableError
from ffplane_contract.warm import readiness
from statestore.replicas import ReplicaStore
from statestore.routes._node import NodeDep
from statestore.slots import SlotStore

__all__ = ["router"]

router = APIRouter()

_READY_WITHIN_S = 10.0  # the coordinator answered a heartbeat this recently


@router.get("/v1/health")
@router.get("/healthz")
def health() -> dict[str, str]:
    """Liveness: the process serves HTTP."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "not ready; the detail says why"}})
def ready(node: NodeDep) -> JSONResponse:
    """Readiness: the root is prepared, the control socket is up and the coordinator answered
    a heartbeat in the last 10 s (a daemon it does not know cannot take part in the ring)."""
    answered = node.heartbeat.answered_at
    if not node.root.config.socket_path.exists():
        raise UnavailableError("the control socket is not up yet")
    if answered is None:
        raise UnavailableError("no heartbeat answered by the coordinator yet")
    if time.monotonic() - answered > _READY_WITHIN_S:
        raise UnavailableError(f"the coordinator has not answered a heartbeat for {time.monotonic() - answered:.0f} s")
    return JSONResponse({"status": "ready"})


@router.get("/v1/cache")
def cache(node: NodeDep) -> dict[str, Any]:
    """What is cached per dp rank and step, bytes, hits/misses and prefetch lag."""
    config, c = node.root.config, node.root.cache
    return {
        "root": str(config.root),
        "huge_pages": node.root.huge_pages,
        "window": config.window,
        "budget_bytes": node.root.budget.total,
        "bytes": c.cached_bytes(),
        "peak_bytes": c.peak_bytes,
        "fetched_bytes": c.bytes_fetched,
        "streams": [s.describe(config.window) for s in c.streams.values()],
    }


@router.get("/v1/state")
def state(node: NodeDep) -> dict[str, Any]:
    """Roles, committed versions (step, bytes, checksum, slot), unique and razored bytes,
    slot use, and the latency of each save's blocking part and of its commit."""
    config, slots, replicas, service = node.root.config, node.root.slots, node.root.replicas, node.state
    roles = slots.describe(service.replicator is not None, config.parity_k)  # once: the node's figures sum them
    return {
        "slot_bytes": slots.slot_bytes(),
        "budget_bytes": node.root.budget.total,
        "memory": node.root.budget.describe(),
        "durable_dir": str(config.durable_dir) if config.durable_dir else None,
        "durable_every": config.durable_every,
        "durable_written": service.durable_written,
        "node_id": config.node_id,
        "coordinator": node.heartbeat.view,
        "versions": config.versions,
        "held": _held(roles, slots, replicas),
        "roles": roles,
        "parity_k": config.parity_k,
        "parity": replicas.parity.memory() if replicas.parity is not None else None,
        "replicas": replicas.describe(),
        "replica_memory": replicas.memory(),
        "replication": service.replicator.describe() if service.replicator else None,
        "pulled_bytes": service.pulled_bytes,
        "restores_behind": service.restores_behind,
        "warm": readiness(config.warm_dir),  # a warm spare is one with a zygote ready
        "commit_parts": slots.commit_parts.describe(),
        "replica_parts": replicas.finish_parts.describe(),
        "transfer": {
            **(node.bulk.describe() if node.bulk else {"bulk_port": None, "bulk_pushes_received": 0, "bulk_refused": 0}),
            "received_bytes": replicas.received_bytes,
            "reused_files": replicas.reused_files,
        },
    }


def _held(roles: list[dict[str, Any]], slots: SlotStore, replicas: ReplicaStore) -> dict[str, Any]:
    """What this node holds of checkpoints, as a multiple of its own ``roles``' shards."""
    shards = sum(r["memory"]["shard_bytes"] for r in roles)
    here, held = slots.slot_bytes(), replicas.held_bytes()
    return {
        "slots_bytes": here,
        "replicas_bytes": held,
        "shard_bytes": shards,
        "multiple": round((here + held) / shards, 3) if shards else None,
        "survives": sorted({r["memory"]["survives"] for r in roles}),
    }


@router.get("/v1/gate")
async def gate(node: NodeDep) -> dict[str, Any]:  # on the loop: the gate's hint maps are the loop's
    """The link gate: open or why closed, STATE bytes sent through it by priority, time paused."""
    return node.root.gate.describe()


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"description": "Prometheus text exposition", "content": {"text/plain": {"schema": {"type": "string"}}}}},
)
def metrics(node: NodeDep) -> Response:
    return Response(generate_latest(node.registry), media_type=CONTENT_TYPE_LATEST)
