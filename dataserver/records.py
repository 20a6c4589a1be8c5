"""A node's heartbeat records — its inventory (job → role → committed versions) and its workers —
checked one by one, so that one job's bad record is dropped, not the node.

A step out of range or a role that is no role name in one job's inventory had the whole heartbeat
refused (422): the node stopped being seen, was declared dead and left the ring with its
predecessor's replicas, although every other job on it was fine. Each record is now checked on
its own against the same bounds: the ones that fail are dropped, with the reason, and the rest
are applied. Both transports go through here: the HTTP heartbeat (whose answer lists what was
dropped) and the UDP inventory blob (checked when it is decoded). What describes the node itself
(its id, address, budget, UDP session) and the sizes of the lists stay the heartbeat's: those
still refuse it whole.

Validating the whole inventory at once is the fast path (a heartbeat's records are almost always
all good); only when that fails is each job, role and version checked apart.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError

from ffplane_contract.dataserver_http import DroppedRecord, InventoryEntry, Name, WorkerInfo
from ffplane_contract.limits import NAME_PATTERN, is_name

__all__ = ["DropLog", "Drops", "check_inventory", "check_workers"]

log = logging.getLogger(__name__)

_LISTED = 32  # dropped records named one by one in a heartbeat's answer; the rest are counted
_SHOWN_CHARS = 80  # of a bad job or role name, in a reason or a log line

Inventory = dict[str, dict[str, list[dict[str, Any]]]]  # job → role → committed versions

_INVENTORY: TypeAdapter[Any] = TypeAdapter(dict[Name, dict[Name, list[InventoryEntry]]])
_VERSIONS: TypeAdapter[Any] = TypeAdapter(list[InventoryEntry])
_VERSION: TypeAdapter[Any] = TypeAdapter(InventoryEntry)
_WORKERS: TypeAdapter[Any] = TypeAdapter(list[WorkerInfo])
_WORKER: TypeAdapter[Any] = TypeAdapter(WorkerInfo)


@dataclass
class Drops:
    """The records dropped from one heartbeat: the first few named, all counted."""

    listed: list[DroppedRecord] = field(default_factory=list)
    count: int = 0
    firsts: dict[str, DroppedRecord] = field(default_factory=dict)  # each job's first dropped record

    def add(self, job: object, record: str, reason: str) -> None:
        dropped = DroppedRecord(job=_shown(job), record=record, reason=reason)
        self.count += 1
        if len(self.listed) < _LISTED:
            self.listed.append(dropped)
        self.firsts.setdefault(dropped.job, dropped)

    def answer(self) -> dict[str, Any]:
        """The part of a heartbeat's answer that says what was dropped (``RingView.dropped``)."""
        return {"dropped": [d.model_dump() for d in self.listed], "dropped_count": self.count}


def _shown(name: object) -> str:
    text = name if isinstance(name, str) else repr(name)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."


def _reason(exc: ValidationError) -> str:
    err = exc.errors(include_url=False)[0]
    loc = ".".join(str(x) for x in err.get("loc", ()))
    got = repr(err.get("input"))
    got = got if len(got) <= _SHOWN_CHARS else got[:_SHOWN_CHARS] + "..."
    return f"{loc + ': ' if loc else ''}{err.get('msg', 'invalid')} (got {got})"


def _name_reason(what: str, name: object) -> str:
    return f"{what} name {_shown(name)!r} must match {NAME_PATTERN}"


def check_inventory(raw: Any, drops: Drops) -> Inventory:
    """``raw`` (job → role → versions) with every record that fails its check dropped into
    ``drops``: a version (a step out of range, a field of the wrong type), a role (a name that is
    no role name, versions that are no list) or a job (no job name, roles that are no object)."""
    try:
        return _INVENTORY.validate_python(raw)
    except ValidationError:
        pass
    if not isinstance(raw, dict):
        drops.add("", "inventory", f"not an object of job -> role -> versions (got {type(raw).__name__})")
        return {}
    out: Inventory = {}
    for job, roles in raw.items():
        where = f"inventory.{_shown(job)}"
        if not is_name(job):
            drops.add(job, where, _name_reason("job", job))
        elif not isinstance(roles, dict):
            drops.add(job, where, f"not an object of role -> versions (got {type(roles).__name__})")
        else:
            out[job] = _check_roles(job, roles, drops)
    return out


def _check_roles(job: str, roles: dict[Any, Any], drops: Drops) -> dict[str, list[dict[str, Any]]]:
    kept: dict[str, list[dict[str, Any]]] = {}
    for role, versions in roles.items():
        where = f"inventory.{job}.{_shown(role)}"
        if not is_name(role):
            drops.add(job, where, _name_reason("role", role))
            continue
        try:
            kept[role] = _VERSIONS.validate_python(versions)
            continue
        except ValidationError:
            pass
        if not isinstance(versions, list):
            drops.add(job, where, f"not a list of versions (got {type(versions).__name__})")
            continue
        good = []
        for i, version in enumerate(versions):
            try:
                good.append(_VERSION.validate_python(version))
            except ValidationError as exc:
                drops.add(job, f"{where}[{i}]", _reason(exc))
        kept[role] = good
    return kept


def check_workers(raw: Any, name: str, drops: Drops) -> list[dict[str, Any]]:
    """The workers (``name``: ``workers`` or ``exited``) of ``raw`` that pass their check; the
    others are dropped into ``drops``."""
    try:
        return _WORKERS.validate_python(raw)
    except ValidationError:
        pass
    if not isinstance(raw, list):
        drops.add("", name, f"not a list of workers (got {type(raw).__name__})")
        return []
    good = []
    for i, worker in enumerate(raw):
        try:
            good.append(_WORKER.validate_python(worker))
        except ValidationError as exc:
            job = worker.get("job", "") if isinstance(worker, dict) else ""
            drops.add(job, f"{name}[{i}]", _reason(exc))
    return good


class DropLog:
    """Counts dropped records and logs each node's and job's first one (a bad record comes back
    with every heartbeat: the log says it once, the count goes on)."""

    _REMEMBERED = 1 << 16  # (node, job) pairs already logged; forgotten all at once past this

    def __init__(self) -> None:
        self.total = 0
        self._logged: set[tuple[str, str]] = set()

    def note(self, node_id: str, drops: Drops) -> None:
        self.total += drops.count
        for d in drops.firsts.values():
            if (node_id, d.job) in self._logged:
                continue
            if len(self._logged) >= self._REMEMBERED:
                self._logged.clear()
            self._logged.add((node_id, d.job))
            log.warning(
                "heartbeat record dropped: %s: %s (the node's other records are applied)",
                d.record,
                d.reason,
                extra={"node": node_id, "job": d.job, "record": d.record, "reason": d.reason, "dropped_in_beat": drops.count},
            )
