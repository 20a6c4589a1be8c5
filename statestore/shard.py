"""The shard model: a committed shard held on this node, whether a slot version of a role saving
here (primary), a replica pushed by the ring predecessor, or a shard pulled for a restore; and
the record of copies found corrupt, here or elsewhere, so that none is offered or asked for again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ffplane_contract.checksum import checksum
from ffplane_contract.shard import PER_STEP, header_intact
from statestore.replicas import Replica, ReplicaStore
from statestore.slots import SlotStore, Version

log = logging.getLogger(__name__)


@dataclass
class LocalShard:
    """A committed shard held here, as a slot version (primary) or a replica."""

    job: str
    role: str
    step: int
    rel: str  # file relative to the root
    nbytes: int
    checksum: str
    header: dict[str, Any]
    kind: str  # "primary", "replica" or "pulled"
    _owner: Version | Replica
    _slots: SlotStore
    _replicas: ReplicaStore
    static: str = ""  # digest of the header's static part, as the store holding it keeps it

    @property
    def header_digest(self) -> str:
        return self._owner.header_digest

    def header_parts(self) -> tuple[str, dict[str, Any], dict[str, Any]]:
        """(digest, static part, per-step part) of the header: a push sends the static part only
        to a peer that may not have it. ("", {}, header) when it has none."""
        if self.static:
            if self.kind == "primary":
                rs = self._slots.roles.get((self.job, self.role))
                static = rs.statics.get(self.static) if rs is not None else None
            else:
                static = self._replicas.statics.get((self.job, self.role), {}).get(self.static)
            step_part = {k: self.header[k] for k in PER_STEP if k in self.header}
            if static is not None and set(static) | set(step_part) == set(self.header):
                return self.static, static, step_part
        return "", {}, self.header

    def path(self) -> str:
        return f"{(self._slots if self.kind == 'primary' else self._replicas).root}/{self.rel}"

    def view(self) -> memoryview:
        store = self._slots if self.kind == "primary" else self._replicas
        return memoryview(store.mapped(self.rel))[: self.nbytes]

    def intact(self) -> bool:
        """Whether the bytes still match the checksum recorded at commit, and the header its digest."""
        return checksum(self.view()) == self.checksum and header_intact(self.header, self.header_digest)

    def current(self) -> bool:
        """Still held (a save may reuse a primary's slot; replicas give way to newer ones)."""
        if self.kind == "primary":
            rs = self._slots.roles.get((self.job, self.role))
            return rs is not None and rs.versions.get(self.step) is self._owner
        return self._replicas.get(self.job, self.role, self.step) is self._owner

    def meta(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "role": self.role,
            "step": self.step,
            "nbytes": self.nbytes,
            "checksum": self.checksum,
            "header": self.header,
            "header_digest": self.header_digest,
            "kind": self.kind,
        }


def find_local(slots: SlotStore, replicas: ReplicaStore, job: str, role: str, step: int) -> LocalShard | None:
    rs = slots.roles.get((job, role))
    v = rs.versions.get(step) if rs else None
    if v is not None:
        return LocalShard(job, role, step, v.path, v.nbytes, v.checksum, v.header, "primary", v, slots, replicas, v.static)
    r = replicas.get(job, role, step)
    if r is not None:
        return LocalShard(job, role, step, r.path, r.nbytes, r.checksum, r.header, r.kind, r, slots, replicas, r.static)
    return None


class CorruptCopies:
    """Copies found corrupt, as (job, role, step, where): ``where`` is a node id, or a name the
    state service gives the durable tier. Its own store of them, apart from the state service:
    the ring policy drops a copy a receiver refused, and is built before the state service."""

    def __init__(self, node_id: str, slots: SlotStore, replicas: ReplicaStore) -> None:
        self.node_id = node_id
        self._slots = slots
        self._replicas = replicas
        self._known: set[tuple[str, str, int, str]] = set()
        self.dropped = 0  # copies held here that were dropped

    def __contains__(self, copy: tuple[str, str, int, str]) -> bool:
        return copy in self._known

    def add(self, job: str, role: str, step: int, where: str) -> None:
        self._known.add((job, role, step, where))

    def job_saved(self, job: str) -> None:
        """The job moved on: a step saved again later is a new version, with new copies."""
        if self._known:
            self._known = {b for b in self._known if b[0] != job}

    def quarantine(self, shard: LocalShard) -> None:
        """Drop a copy held here that failed its checksum, and never offer it again."""
        log.warning(
            "corrupt shard dropped: it fails its checksum; another copy of the same step is used if one is intact",
            extra={"job": shard.job, "role": shard.role, "step": shard.step, "kind": shard.kind, "path": shard.rel},
        )
        self.add(shard.job, shard.role, shard.step, self.node_id)
        if shard.kind == "primary":
            self._slots.drop(shard.job, shard.role, shard.step)
        else:
            self._replicas.drop(shard.job, shard.role, shard.step)
        self.dropped += 1
