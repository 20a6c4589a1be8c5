"""The whole cluster in one answer (``GET /v1/cluster``): what the status page at ``/`` and
``ffplane status`` show.

The coordinator knows the nodes, the ring, each job's restorable step and where every shard is;
each live daemon's ops API adds its roles and versions, replicas, cache fill and link gate (asked
in parallel, one second each: a daemon that does not answer is shown so, not waited for). A daemon
whose answer cannot be read (no answer, not JSON, NaN, not the shape a daemon answers) is
``{"unreadable": reason}`` and everything else is shown as usual: one odd node must not take the
whole view down (it answered 500). Recent
failures (worker exits, nodes declared dead) come with their recovery: the time from the failure
to the first commit of the job of a step newer than any committed before it, read from the
daemons' kept versions (so a failure older than the three newest versions shows none).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, StrictBool, StrictInt, StrictStr, ValidationError

__all__ = ["cluster_view"]

_DAEMON_TIMEOUT_S = 1.0
_FAILURES_SHOWN = 20
_REASON_CHARS = 200


class _Part(BaseModel):  # what the page, ffplane status and the failures below read; more is kept
    model_config = ConfigDict(strict=True, extra="allow")


class _Version(_Part):
    step: StrictInt = Field(ge=0)
    committed_at: FiniteFloat | None = None


class _Memory(_Part):  # what a role's copies take (statestore.slots: memory)
    here_bytes: FiniteFloat = Field(ge=0)
    successor_bytes: FiniteFloat = Field(ge=0)
    multiple: FiniteFloat = Field(ge=0)
    survives: StrictStr


class _Role(_Part):
    job: StrictStr
    role: StrictStr
    versions: list[_Version] = []
    memory: _Memory | None = None


class _Replica(_Part):
    job: StrictStr
    role: StrictStr
    kind: StrictStr | None = None


class _Held(_Part):  # what a node holds of checkpoints (statestore.routes.ops: held)
    slots_bytes: FiniteFloat = Field(ge=0)
    replicas_bytes: FiniteFloat = Field(ge=0)
    multiple: FiniteFloat | None = Field(default=None, ge=0)
    survives: list[StrictStr] = []


class _State(_Part):
    roles: list[_Role] = []
    replicas: list[_Replica] = []
    slot_bytes: FiniteFloat = 0
    held: _Held | None = None


class _Cache(_Part):
    bytes: FiniteFloat
    budget_bytes: FiniteFloat


class _Gate(_Part):
    open: StrictBool | None = None


_PARTS: dict[str, type[_Part]] = {"state": _State, "cache": _Cache, "gate": _Gate}


async def cluster_view(coordinator: Any, jobs: list[str], leader: str) -> dict[str, Any]:
    members = {
        n: {"address": m.address, "alive": m.alive and not m.unreachable, "unreachable": m.unreachable}
        for n, m in sorted(coordinator.members.items())
    }
    alive = {n: m["address"] for n, m in members.items() if m["alive"]}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_DAEMON_TIMEOUT_S)) as session:
        answers = await asyncio.gather(*(_daemon(session, address) for address in alive.values()))
    daemons = dict(zip(alive, answers))
    statuses = {job: coordinator.status(job) for job in jobs}
    for job, status in statuses.items():
        status["committed_step"] = coordinator.newest_step(job)
    return {
        "leader": leader,
        "ring": coordinator.ring(),
        "members": members,
        "daemons": daemons,
        "jobs": {job: _job_summary(s) for job, s in statuses.items()},
        "failures": _failures(coordinator, daemons),
    }


async def _daemon(session: aiohttp.ClientSession, address: str) -> dict[str, Any]:
    """The daemon's state, cache and gate, or ``{"unreadable": why}`` for the first part that
    cannot be read as a daemon answers it."""
    out: dict[str, Any] = {}
    for part, model in _PARTS.items():
        try:
            async with session.get(f"{address}/v1/{part}") as resp:
                if resp.status != 200:
                    return _unreadable(part, f"HTTP {resp.status}")
                answer = await resp.json(loads=_strict_json)
            model.model_validate(answer)
        except ValidationError as exc:
            first = exc.errors()[0]
            return _unreadable(part, f"{'.'.join(map(str, first['loc'])) or 'the answer'}: {first['msg']}")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, RecursionError) as exc:
            return _unreadable(part, str(exc) or type(exc).__name__)
        out[part] = answer
    return out


def _unreadable(part: str, why: str) -> dict[str, Any]:
    return {"unreadable": f"/v1/{part}: {why}"[:_REASON_CHARS]}


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN would make this whole answer unencodable


def _strict_json(text: str) -> Any:
    return json.loads(text, parse_constant=_refuse_constant)


def _job_summary(status: dict[str, Any]) -> dict[str, Any]:
    keep = ("restorable_step", "committed_step", "roles", "shard_locations", "dead")
    return {k: status.get(k) for k in keep}


def _failures(coordinator: Any, daemons: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    commits: dict[str, list[tuple[float, int]]] = {}  # job → (committed_at, step) of every kept version
    for d in daemons.values():
        for role in d.get("state", {}).get("roles", []) if isinstance(d.get("state"), dict) else []:
            for v in role.get("versions", []):
                if isinstance(v.get("committed_at"), (int, float)):
                    commits.setdefault(role["job"], []).append((float(v["committed_at"]), int(v["step"])))
    events = [
        {"kind": "worker exit", "node": w.get("node"), "at": w.get("at"), "job": w.get("job"), "worker": w.get("role") or w.get("dp_rank")}
        for w in coordinator.worker_exits
    ] + [{"kind": "node lost", "node": d["node"], "at": d["at"], "job": None, "silent_s": d["silent_s"]} for d in coordinator.deaths]
    events = sorted((e for e in events if isinstance(e.get("at"), (int, float))), key=lambda e: -e["at"])[:_FAILURES_SHOWN]
    for e in events:
        jobs = [e["job"]] if e.get("job") in commits else sorted(commits)
        e["recovered_after_s"] = min((r for r in (_recovery(commits[j], e["at"]) for j in jobs) if r is not None), default=None)
    return events


def _recovery(commits: list[tuple[float, int]], at: float) -> float | None:
    """Seconds from ``at`` to the first commit of a step newer than every step committed by then."""
    before = max((step for t, step in commits if t <= at), default=None)
    if before is None:
        return None  # nothing kept from before the failure: cannot tell
    after = [t for t, step in commits if t > at and step > before]
    return round(min(after) - at, 3) if after else None
