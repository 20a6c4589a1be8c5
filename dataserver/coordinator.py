"""Membership of a job's node daemons: heartbeats, dead-node detection, the replication ring,
and the job-wide restorable step.

Nothing here is persisted: every daemon heartbeats each second with its whole inventory, so a
restarted data server knows the cluster again after one heartbeat round, without any daemon or
worker restarting. A node silent for ``dead_after_s`` is declared dead by a sweep that runs every
``sweep_s``; the ring is the alive nodes in node-id order, each replicating to its successor.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class Member:
    node_id: str
    address: str  # the daemon's ops/peer base URL
    budget_bytes: int
    last_seen: float
    inventory: dict[str, dict[str, list[dict[str, Any]]]] = field(default_factory=dict)  # job → role → versions
    workers: list[dict[str, Any]] = field(default_factory=list)
    exited: list[dict[str, Any]] = field(default_factory=list)
    alive: bool = True
    dead_since: float | None = None


class Coordinator:
    def __init__(self, dead_after_s: float = 1.5) -> None:
        self.dead_after_s = dead_after_s
        self.members: dict[str, Member] = {}
        self.worker_exits: list[dict[str, Any]] = []

    def heartbeat(self, node_id: str, address: str, budget_bytes: int, inventory: dict[str, Any], workers: list[dict[str, Any]], exited: list[dict[str, Any]]) -> dict[str, Any]:
        """Record a node's heartbeat (its first one registers it); returns the ring view."""
        now = time.monotonic()
        m = self.members.get(node_id)
        if m is None or not m.alive:
            log.info("node joined" if m is None else "node back", extra={"node": node_id, "address": address})
            m = Member(node_id, address, budget_bytes, now)
            self.members[node_id] = m
        m.address, m.budget_bytes, m.last_seen = address, budget_bytes, now
        m.inventory, m.workers = inventory, workers
        for w in exited:
            log.warning("worker exited", extra={"node": node_id, **w})
            self.worker_exits.append({"node": node_id, "at": time.time(), **w})
        del self.worker_exits[:-256]
        return self.view(node_id)

    def sweep(self) -> list[str]:
        """Declare nodes silent for too long dead; returns those newly declared."""
        now = time.monotonic()
        newly = []
        for m in self.members.values():
            if m.alive and now - m.last_seen > self.dead_after_s:
                m.alive, m.dead_since = False, now
                newly.append(m.node_id)
                log.warning("node declared dead", extra={"node": m.node_id, "silent_s": round(now - m.last_seen, 3)})
        return newly

    def ring(self) -> list[str]:
        return sorted(n for n, m in self.members.items() if m.alive)

    def successor(self, node_id: str) -> str | None:
        ring = self.ring()
        if node_id not in ring or len(ring) < 2:
            return None
        return ring[(ring.index(node_id) + 1) % len(ring)]

    def view(self, node_id: str) -> dict[str, Any]:
        succ = self.successor(node_id)
        return {
            "ring": self.ring(),
            "successor": succ,
            "successor_address": self.members[succ].address if succ else None,
            "dead": sorted(n for n, m in self.members.items() if not m.alive),
        }

    def status(self, job: str) -> dict[str, Any]:
        """Members, ring, dead nodes, where each role's shards are, and the restorable step."""
        locations: dict[str, dict[int, list[str]]] = {}
        expected: set[str] = set()
        for m in self.members.values():
            for role, versions in m.inventory.get(job, {}).items():
                for v in versions:
                    try:
                        step, peers = int(v["step"]), [str(r) for r in v.get("layout_roles", [role])]
                    except (KeyError, TypeError, ValueError):
                        log.warning("malformed inventory entry ignored", extra={"node": m.node_id, "job": job, "role": role})
                        continue
                    if m.alive:
                        locations.setdefault(role, {}).setdefault(step, []).append(m.node_id)
                    expected |= set(peers)
        restorable = None
        if expected and expected <= set(locations):
            common = set.intersection(*(set(locations[r]) for r in expected))
            restorable = max(common) if common else None
        return {
            "job": job,
            "members": {
                n: {"address": m.address, "alive": m.alive, "budget_bytes": m.budget_bytes, "workers": m.workers, "silent_s": round(time.monotonic() - m.last_seen, 3)}
                for n, m in sorted(self.members.items())
            },
            "ring": self.ring(),
            "dead": sorted(n for n, m in self.members.items() if not m.alive),
            "restorable_step": restorable,
            "roles": sorted(expected),
            "shard_locations": {r: {str(s): nodes for s, nodes in sorted(steps.items())} for r, steps in sorted(locations.items())},
            "worker_exits": [w for w in self.worker_exits if w.get("job") in (None, job)][-32:],
        }
