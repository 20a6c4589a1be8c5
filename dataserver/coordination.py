"""This data server's part in coordinating the node daemons: its ``Coordinator``, whether it may
answer for it now, and the loops that keep membership current.

Without etcd the server coordinates always. With etcd, several servers serve the same jobs and one
at a time coordinates (``Leadership``); a server that just took over answers no ring view until
the daemons' heartbeats have had time to find it (``settle_s``), so none is handed a ring missing
nodes that are alive (``shared_jobs``, ``leadership``).

``start()`` begins the loops: the sweep that declares silent nodes dead, the reprobe of members
out of the ring as unreachable, with etcd the campaign for the lead and the dead board, and the UDP
heartbeat listener. ``stop()`` ends them and hands the lead over; it is safe to call twice.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Coroutine
from typing import Any

import aiohttp

from dataserver.config import ServeConfig
from dataserver.coordinator import Coordinator, listen_udp
from dataserver.dead_board import DeadBoard
from dataserver.leadership import Leadership
from ffplane_contract.errors import NotCoordinatorError, UnavailableError
from ffplane_runtime.etcd import ALIVE_KEY, Etcd, EtcdUnavailable

log = logging.getLogger(__name__)

_PROBE_S = 1.5  # how long the coordinator waits for a reported node's health check
_REPROBE_S = 2.0  # how often unreachable members are checked again


class Coordination:
    def __init__(self, config: ServeConfig, token: str | None, etcd: Etcd | None) -> None:
        """``token``: the job token (UDP beats are signed with it; none: no UDP listener);
        ``etcd``: where the lead is held, None for a server that coordinates alone."""
        self.coordinator = Coordinator(config.dead_after_s, token, forget_after_s=config.forget_dead_after_s)
        self._config, self._token, self._etcd = config, token, etcd
        self._settle_s = max(config.dead_after_s, 1.0) + 0.5
        self.leading = etcd is None  # whether this server coordinates now
        self._settled_at = 0.0  # monotonic time from which it answers ring views
        self.leadership = Leadership(etcd, self.url, self._on_lead_change) if etcd is not None else None
        self._tasks: list[asyncio.Task[None]] = []
        self._udp: asyncio.DatagramTransport | None = None

    @property
    def url(self) -> str:
        """This server's URL (the port bound, once it is: ``--port 0``)."""
        return self._config.url(self._config.port)

    @property
    def leader(self) -> str | None:
        """The URL of the server that coordinates, as last seen (None while none does)."""
        return self.leadership.leader if self.leadership is not None else self.url

    # --- what a coordinator route checks first ------------------------------------------------
    def check_leading(self) -> None:
        """NotCoordinatorError, naming the server that coordinates, unless this one does."""
        if not self.leading:
            leader = self.leader
            where = f"send it to {leader}" if leader and leader != self.url else "no server coordinates yet; retry shortly"
            raise NotCoordinatorError(f"this data server does not coordinate now: {where}", leader=leader)

    def check_settled(self) -> None:
        """UnavailableError while this server, just taken over, still collects the nodes' heartbeats."""
        left = self._settled_at - time.monotonic()
        if left > 0:
            raise UnavailableError(
                f"this data server took over coordination and is collecting the nodes' heartbeats; retry in {left:.1f} s"
            )

    # --- the lead changing hands --------------------------------------------------------------
    def _on_lead_change(self, leading: bool, took_over: bool) -> None:
        self.coordinator.reset()
        self.leading, self._settled_at = leading, time.monotonic() + (self._settle_s if took_over else 0.0)
        if leading and took_over and self._etcd is not None:
            self._expect_previous(self._etcd)

    def _expect_previous(self, etcd: Etcd) -> None:
        """The nodes the previous coordinator had alive join the ring at once, and one that never
        beats here (lost in the hand-over) is declared dead like any other. Read here, on the
        loop, before this server's dead board can overwrite the key."""
        try:
            kv = etcd.get(ALIVE_KEY, retry_s=1.0)
            members = json.loads(kv.value) if kv is not None else {}
            if not isinstance(members, dict):
                raise ValueError(f"not a JSON object: {kv.value[:80]!r}" if kv is not None else "")
        except (EtcdUnavailable, ValueError) as exc:
            log.warning("cannot read the previous coordinator's nodes; they register with their next heartbeat", extra={"error": str(exc)})
            return
        added = self.coordinator.expect({str(n): str(a) for n, a in members.items()}, self._settle_s)
        log.info("expecting the previous coordinator's nodes", extra={"nodes": added})

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the loops (on the event loop that serves): see the module's docstring."""
        self._spawn(self._sweep(), "coordinator sweep")
        self._spawn(self._reprobe(), "coordinator reprobe")
        if self._etcd is not None and self.leadership is not None:
            self.leadership.url = self.url  # the port bound, for --port 0
            await self.leadership.start()
            self._spawn(self.leadership.run(), "leadership")
            self._spawn(DeadBoard(self._etcd, self.coordinator, lambda: self.leading).run(self._config.sweep_s), "dead board")
        if self._config.heartbeat_udp_port >= 0 and self._token is not None:
            self._udp = await listen_udp(self.coordinator, self._config.host, self._config.heartbeat_udp_port)

    async def stop(self) -> None:
        """Stop listening and the loops, and hand the lead over; safe to call twice."""
        if self._udp is not None:
            self._udp.close()
            self._udp = None
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.leadership is not None:
            await self.leadership.resign()

    def _spawn(self, loop: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(loop, name=name)
        task.add_done_callback(_report_end)
        self._tasks.append(task)

    async def probe(self, address: str) -> bool:
        """Whether a daemon's peer port answers the coordinator (its health check, within 1.5 s)."""
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_PROBE_S)) as session,
                session.get(f"{address}/v1/health") as resp,
            ):
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return False

    async def _reprobe(self) -> None:
        """Members taken out of the ring as unreachable go back once they answer again."""
        while True:
            await asyncio.sleep(_REPROBE_S)
            for node_id, address in self.coordinator.unreachable().items():
                if await self.probe(address):
                    self.coordinator.set_unreachable(node_id, False)

    async def _sweep(self) -> None:
        sweep_s = self._config.sweep_s
        due = time.monotonic()
        while True:
            # A sweep that runs late (the loop stalled) declares nobody dead: beats queued in the
            # socket during the stall are read first, and the next sweep judges.
            if time.monotonic() - due < sweep_s:
                self.coordinator.sweep()
            due = time.monotonic() + sweep_s
            await asyncio.sleep(sweep_s)


def _report_end(task: asyncio.Task[None]) -> None:
    """A loop that ends by itself has failed: said, with its traceback, rather than lost."""
    if not task.cancelled() and task.exception() is not None:
        log.error("%s ended", task.get_name(), exc_info=task.exception(), extra={"task": task.get_name()})
