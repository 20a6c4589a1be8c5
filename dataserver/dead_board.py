"""The coordinator's verdicts, published in etcd for torchrun's rendezvous (``--rdzv-backend
ffplane``, ``trainer_client.rendezvous``): a key per node declared dead, removed once the node is
back in the ring. Agents read them to drop a dead peer at once instead of waiting out torch's
keep-alive (decisions.md, "No single point of failure: etcd holds what outlives a host").
Beside them, the alive members and their addresses (``ALIVE_KEY``), from which a data server
that takes over coordination starts (``Coordinator.expect``). Only the coordinating server writes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

from dataserver.coordinator import Coordinator
from ffplane_runtime.etcd import ALIVE_KEY, DEAD_PREFIX, Etcd, EtcdUnavailable

log = logging.getLogger(__name__)

_REPAIR_S = 5.0  # with nothing changed, etcd is compared with the coordinator this often


class DeadBoard:
    def __init__(self, etcd: Etcd, coordinator: Coordinator, leading: Callable[[], bool]) -> None:
        """``leading``: whether this server coordinates now (only the one that does publishes)."""
        self._etcd, self._coordinator, self._leading = etcd, coordinator, leading
        self._published: set[str] | None = None  # what etcd holds, as far as this process knows
        self._alive: dict[str, str] | None = None  # the alive members last written (node → address)

    def _publish(self, dead: set[str], alive: dict[str, str]) -> None:
        """Blocking: make etcd's keys say ``dead``; a key of a node in ``alive`` goes; ``alive``
        (node → address) is written for a coordinator that takes over (``Coordinator.expect``)."""
        if alive != self._alive:
            self._etcd.put(ALIVE_KEY, json.dumps(alive).encode())
            self._alive = dict(alive)
        if self._published is None:
            self._published = {kv.key[len(DEAD_PREFIX) :].decode() for kv in self._etcd.get_prefix(DEAD_PREFIX)}
        for node in sorted(dead - self._published):
            self._etcd.put(DEAD_PREFIX + node.encode(), json.dumps({"declared_at": time.time()}).encode())
            self._published.add(node)
            log.info("dead node published for the rendezvous", extra={"node": node})
        for node in sorted(self._published & alive.keys()):
            self._etcd.delete(DEAD_PREFIX + node.encode())
            self._published.discard(node)

    async def run(self, every_s: float) -> None:
        """Publish each change of the coordinator's dead set (and repair every few seconds)."""
        last: tuple[set[str], dict[str, str]] | None = None
        repaired = 0.0
        while True:
            if not self._leading():
                last, self._published, self._alive = None, None, None  # a later turn reads back what etcd holds
                await asyncio.sleep(every_s)
                continue
            members = self._coordinator.members
            dead, alive = set(self._coordinator.dead()), {n: members[n].address for n in self._coordinator.ring()}
            if (dead, alive) != last or time.monotonic() - repaired > _REPAIR_S:
                try:
                    await asyncio.to_thread(self._publish, dead, alive)
                    last, repaired = (dead, alive), time.monotonic()
                except (EtcdUnavailable, ValueError) as exc:
                    self._published = None  # read back what etcd holds once it answers
                    log.warning("cannot publish dead nodes to etcd; retrying", extra={"error": str(exc)})
            await asyncio.sleep(every_s)
