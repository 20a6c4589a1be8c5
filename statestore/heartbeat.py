"""The daemon's heartbeat to the coordinator: every second, or at once when a local worker exits.

Each heartbeat carries the whole shard inventory and the live local workers, so a restarted data
server rebuilds its membership from one round. The answer names the replication ring and this
node's successor (used by replication, a later piece).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp

from statestore.config import DaemonConfig
from statestore.slots import SlotStore

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self, config: DaemonConfig, slots: SlotStore, token: str | None) -> None:
        self.config = config
        self.slots = slots
        self.token = token
        self.address = ""  # set once the ops port is bound
        self.workers: dict[int, dict[str, Any]] = {}  # connection id → {pid, job, role|dp_rank}
        self._exited: list[dict[str, Any]] = []
        self._now = asyncio.Event()
        self.view: dict[str, Any] = {}
        self.sent = self.failed = 0
        self._last_warning = 0.0

    def worker_gone(self, info: dict[str, Any]) -> None:
        """A local worker's connection closed and its process is gone: tell the coordinator now."""
        self._exited.append(info)
        self._now.set()

    def inventory(self) -> dict[str, dict[str, list[dict[str, Any]]]]:
        out: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for rs in self.slots.roles.values():
            out.setdefault(rs.job, {})[rs.role] = [
                {"step": v.step, "checksum": v.checksum, "nbytes": v.nbytes, "layout_roles": v.header.get("layout_roles", [rs.role])}
                for v in rs.newest()
            ]
        return out

    async def run(self) -> None:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        url = f"{self.config.dataserver}/v1/nodes/heartbeat"
        # A fixed rate from a deadline (a slow answer does not stretch the period) and a timeout
        # well inside it, so one slow round trip cannot make this node look silent.
        timeout = aiohttp.ClientTimeout(total=max(0.2, self.config.heartbeat_s / 2))
        next_at = time.monotonic()
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                next_at += self.config.heartbeat_s
                exited, self._exited = self._exited, []
                body = {
                    "node_id": self.config.node_id,
                    "address": self.address,
                    "budget_bytes": self.config.budget_bytes,
                    "inventory": self.inventory(),
                    "workers": list(self.workers.values()),
                    "exited": exited,
                }
                try:
                    async with session.post(url, json=body, headers=headers) as resp:
                        if resp.status != 200:
                            raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status, message=(await resp.text())[:300])
                        self.view = await resp.json()
                        self.sent += 1
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    self._exited = exited + self._exited  # say it again next time
                    self.failed += 1
                    if time.monotonic() - self._last_warning > 10:
                        self._last_warning = time.monotonic()
                        log.warning("heartbeat failed", extra={"dataserver": self.config.dataserver, "error": str(exc)})
                try:
                    await asyncio.wait_for(self._now.wait(), timeout=max(0.0, next_at - time.monotonic()))
                    next_at = time.monotonic()  # an urgent beat (a worker exited) restarts the period
                except asyncio.TimeoutError:
                    pass
                self._now.clear()
                next_at = max(next_at, time.monotonic() - self.config.heartbeat_s)
