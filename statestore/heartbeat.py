"""The daemon's heartbeat to the coordinator: every second, or at once when a local worker exits.

The coordinator holds the whole shard inventory and the live local workers of every node, so a
restarted data server rebuilds its membership from one round. Registration is a full HTTP
heartbeat; then liveness is a small UDP datagram (HMAC with the job token) carrying the
inventory only when it changed — see ``Heartbeat.run`` and ``dataserver/coordinator.py``. The
answers keep ``view``: the replication ring, this node's successor, dead nodes and the alive
members' addresses.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import urllib.parse
from collections import deque
from typing import Any

import aiohttp

from ffplane_contract.auth import bearer
from ffplane_contract.dataserver_http import HeartbeatBody, RingView, UdpSession
from ffplane_contract.heartbeat import (
    KIND_BEAT,
    KIND_INV,
    STATUS_STALE,
    STATUS_UNKNOWN,
    VIEW_EVENTS,
    VIEW_FULL,
    Answer,
    Beat,
    decode_events,
    encode_inventory,
)
from ffplane_contract.ring import successor
from statestore.config import DaemonConfig
from statestore.dataservers import DataServers
from statestore.replicas import ReplicaStore
from statestore.slots import SlotStore

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(
        self, config: DaemonConfig, slots: SlotStore, replicas: ReplicaStore | None, address: str, token: str | None, servers: DataServers
    ) -> None:
        """``replicas``: listed in the inventory once complete; ``address``: the peer API's base
        URL, as the other daemons reach it (the port is bound before the daemon starts);
        ``servers``: where the coordinator is."""
        self.config = config
        self.servers = servers
        self.slots = slots
        self.token = token
        self.address = address
        self.replicas = replicas
        self.workers: dict[int, dict[str, Any]] = {}  # connection id → {pid, job, role|dp_rank}
        self._gone: deque[Any] = deque(maxlen=256)  # pids reported exited (pids are reused, eventually)
        self._ending: deque[int] = deque(maxlen=256)  # pids that said they end cleanly (control 'bye')
        self._exited: list[dict[str, Any]] = []
        self._now = asyncio.Event()
        self.view: dict[str, Any] = {}
        self.sent = self.failed = 0
        self.answered_at: float | None = None  # when the coordinator last answered a beat (for /readyz)
        self._last_warning = 0.0

    def worker_ending(self, pid: int) -> None:
        """Process ``pid`` said it ends cleanly (exit code 0, no unhandled exception): its exit is
        no failure. A pid this daemon cannot see (0: another pid namespace) is not recorded."""
        if pid > 0 and pid not in self._ending:
            self._ending.append(pid)

    def worker_gone(self, info: dict[str, Any]) -> None:
        """A local worker's connection closed and its process is gone: tell the coordinator now,
        once per process (a worker has a connection for its DataLoader and one for its state),
        unless it said it ended cleanly — the end of a job is no failure to list."""
        pid = info.get("pid")
        for rid, other in list(self.workers.items()):
            if other.get("pid") == pid:  # its other connections: one report names all it did
                info = {**other, **info}
                del self.workers[rid]
        if pid in self._gone:
            return
        self._gone.append(pid)
        if isinstance(pid, int) and pid in self._ending:
            self._ending.remove(pid)
            log.info("worker ended cleanly", extra={"worker": info})
            return
        self._exited.append(info)
        self._now.set()

    async def report_unreachable(self, node: str) -> None:
        """Tell the coordinator that ``node`` (this node's ring successor) takes no connection;
        it checks for itself and moves the ring past it."""
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
                status, body = await self.servers.coordinator(
                    session, "POST", f"/v1/nodes/{node}/unreachable", json={"reporter": self.config.node_id}, headers=bearer(self.token)
                )
            if status != 200:
                log.warning(
                    "the coordinator did not take the report",
                    extra={"node": node, "status": status, "detail": body[:300].decode(errors="replace")},
                )
                return
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.warning("cannot report an unreachable successor", extra={"node": node, "error": str(exc)})
        self._now.set()  # beat now: the answer brings the new ring

    def inventory(self) -> dict[str, dict[str, list[dict[str, Any]]]]:
        """job → role → the committed versions held here: this node's own saves, then complete,
        verified replicas (a role saving here and replicated here lists both)."""
        out: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for rs in self.slots.roles.values():
            out.setdefault(rs.job, {})[rs.role] = [
                {"step": v.step, "checksum": v.checksum, "nbytes": v.nbytes, "layout_roles": v.header.get("layout_roles", [rs.role])}
                for v in rs.newest(len(rs.versions))
            ]
        if self.replicas is not None:
            for (job, role), versions in self.replicas.complete.items():
                entries = out.setdefault(job, {}).setdefault(role, [])
                for r in versions.values():
                    entries.append(
                        {
                            "step": r.step,
                            "checksum": r.checksum,
                            "nbytes": r.nbytes,
                            "layout_roles": r.header.get("layout_roles", [role]),
                            "replica_of": r.source,
                        }
                    )
            parity = self.replicas.parity
            for job in parity.jobs() if parity is not None else ():
                assert parity is not None
                for role, members in parity.inventory(job).items():  # a lost member's shard is rebuilt here
                    out.setdefault(job, {}).setdefault(role, []).extend(
                        {
                            "step": m.step,
                            "checksum": m.checksum,
                            "nbytes": m.nbytes,
                            "layout_roles": m.header.get("layout_roles", [role]),
                            "replica_of": m.source,
                        }
                        for m in members
                    )
        return out

    async def run(self) -> None:
        """Heartbeat every ``heartbeat_s`` (at once when a local worker exits) until cancelled.

        A full HTTP heartbeat registers this daemon process (and its UDP session) and learns the
        coordinator's UDP port; it is sent first, whenever workers exited, when the address
        changed or the inventory is too big for a datagram, and whenever UDP goes unanswered or
        the coordinator answers "unknown node" (it restarted, or declared this node dead). The
        other beats are authenticated UDP datagrams carrying the inventory only when it changed;
        their answer brings the ring view's missed membership events (or asks for a GET of the
        whole view).
        """
        # A fixed rate from a deadline (a slow answer does not stretch the period) and a timeout
        # well inside it, so one slow round trip cannot make this node look silent.
        timeout = aiohttp.ClientTimeout(total=max(0.2, self.config.heartbeat_s / 2))
        next_at = time.monotonic()
        async with aiohttp.ClientSession(timeout=timeout) as session:
            beats = _Beats(self, session)
            try:
                while True:
                    next_at += self.config.heartbeat_s
                    await beats.beat()
                    try:
                        await asyncio.wait_for(self._now.wait(), timeout=max(0.0, next_at - time.monotonic()))
                        next_at = time.monotonic()  # an urgent beat (a worker exited) restarts the period
                    except asyncio.TimeoutError:
                        pass
                    self._now.clear()
                    next_at = max(next_at, time.monotonic() - self.config.heartbeat_s)
            finally:
                beats.close()


class _Answers(asyncio.DatagramProtocol):
    """Authentic coordinator answers, handed to the beat waiting for their counter."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.waiting: dict[int, asyncio.Future[Answer]] = {}

    def datagram_received(self, data: bytes, addr: Any) -> None:
        answer = Answer.decode(self.key, data)
        if answer is not None and (fut := self.waiting.pop(answer.counter, None)) is not None and not fut.done():
            fut.set_result(answer)

    def error_received(self, exc: Exception) -> None:  # an ICMP error: the beat stays unanswered
        pass


class _Beats:
    """The transport state of one daemon process's heartbeats (see ``Heartbeat.run``)."""

    def __init__(self, hb: Heartbeat, http: aiohttp.ClientSession) -> None:
        self.hb, self.http = hb, http
        self.servers = hb.servers
        self.acked_url = ""  # the coordinator that took the last full heartbeat (UDP beats go to it)
        self.headers = bearer(hb.token)
        self.key = hb.token.encode() if hb.token else None
        self.session_id = os.urandom(8)  # this process's UDP session, registered over HTTP
        self.counter = 0  # every message takes the next value; the coordinator drops replays
        self.inv_version = 0  # the version of the inventory the coordinator acknowledged
        self.acked: tuple[str, int, bytes | None] | None = None  # (address, budget, inventory payload) it holds
        self.udp_port: int | None = None
        self.udp_addr: Any = None
        self.transport: asyncio.DatagramTransport | None = None
        self.answers: _Answers | None = None
        self.udp_failures = 0
        self.udp_off_until = 0.0
        self.attempt_s = max(0.02, min(0.15, hb.config.heartbeat_s / 8))  # a datagram is resent once after this
        self.epoch, self.version = 0, 0  # of the ring view held in members/dead
        self.members: dict[str, str] = {}
        self.dead: set[str] = set()
        self.full_view_after = 0.0

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    async def beat(self) -> None:
        hb = self.hb
        inventory, workers = hb.inventory(), list(hb.workers.values())
        payload = encode_inventory(inventory, workers)
        ident = (hb.address, hb.config.budget_bytes)
        fits = Beat.room(hb.config.node_id, payload)
        if (
            self.acked is not None
            and self.acked_url == self.servers.leader
            and self.acked[:2] == ident
            and not hb._exited
            and self.udp_port is not None
            and fits
            and time.monotonic() >= self.udp_off_until
            and await self._udp(payload)
        ):
            return
        await self._full(inventory, workers, payload, ident)

    async def _udp(self, payload: bytes) -> bool:
        """One UDP beat (sent again once if unanswered); False if a full heartbeat must follow."""
        assert self.key is not None and self.acked is not None
        if not await self._open_udp():
            return False
        assert self.transport is not None and self.answers is not None
        kind = KIND_BEAT if payload == self.acked[2] else KIND_INV
        answer: Answer | None = None
        inv = self.inv_version
        for _ in range(2):
            self.counter += 1
            counter = self.counter
            inv = counter if kind == KIND_INV else self.inv_version
            datagram = Beat(
                kind, self.hb.config.node_id, self.session_id, counter, inv, self.epoch, self.version, payload if kind == KIND_INV else b""
            ).encode(self.key)
            fut = asyncio.get_running_loop().create_future()
            self.answers.waiting[counter] = fut
            try:
                self.transport.sendto(datagram, self.udp_addr)
                answer = await asyncio.wait_for(fut, self.attempt_s)
                break
            except (asyncio.TimeoutError, OSError):
                pass
            finally:
                self.answers.waiting.pop(counter, None)
        if answer is None:
            self.udp_failures += 1
            if self.udp_failures >= 3:  # UDP blocked on the way? HTTP only for a while
                self.udp_off_until = time.monotonic() + 60
                self.udp_failures = 0
                log.warning(
                    "UDP heartbeats unanswered; using HTTP for 60 s", extra={"dataserver": self.acked_url, "udp_port": self.udp_port}
                )
            return False
        self.udp_failures = 0
        status, view, epoch, version = answer.status, answer.view, answer.epoch, answer.version
        if status == STATUS_UNKNOWN:
            return False
        self.hb.sent += 1
        self.hb.answered_at = time.monotonic()
        if status == STATUS_STALE:
            self.acked = (*self.acked[:2], None)  # the next beat carries the inventory
        elif kind == KIND_INV:
            self.acked, self.inv_version = (*self.acked[:2], payload), inv
        if view == VIEW_EVENTS and epoch == self.epoch:
            try:
                for event in decode_events(answer.events):
                    if event[0] == "+":
                        self.members[str(event[1])] = str(event[2])
                        self.dead.discard(str(event[1]))
                    else:
                        self.members.pop(str(event[1]), None)
                        self.dead.add(str(event[1]))
            except (ValueError, TypeError, IndexError):
                view = VIEW_FULL
            else:
                self.version = version
                self._publish()
        if (view == VIEW_FULL or (view == VIEW_EVENTS and epoch != self.epoch)) and time.monotonic() >= self.full_view_after:
            # at most one whole view every 5 s: in a storm of joins and deaths, 4,096 daemons
            # fetching ~180 KB each on every beat would feed the storm
            self.full_view_after = time.monotonic() + 5.0
            await self._get_view()
        return True

    async def _open_udp(self) -> bool:
        if self.udp_addr is not None:
            return True
        assert self.key is not None and self.udp_port is not None
        loop = asyncio.get_running_loop()
        try:
            host = urllib.parse.urlsplit(self.acked_url).hostname or "127.0.0.1"
            family, _, _, _, addr = (await loop.getaddrinfo(host, self.udp_port, type=socket.SOCK_DGRAM))[0]
            if self.transport is None or self.transport.get_extra_info("socket").family != family:
                self.close()
                self.transport, self.answers = await loop.create_datagram_endpoint(lambda: _Answers(self.key or b""), family=family)
        except OSError as exc:
            log.warning("cannot open the UDP heartbeat socket", extra={"dataserver": self.acked_url, "error": str(exc)})
            self.udp_off_until = time.monotonic() + 60
            return False
        self.udp_addr = addr
        return True

    async def _full(self, inventory: dict[str, Any], workers: list[dict[str, Any]], payload: bytes, ident: tuple[str, int]) -> None:
        hb = self.hb
        exited, hb._exited = hb._exited, []
        self.counter += 1
        udp = UdpSession(session=self.session_id.hex(), counter=self.counter, inv_version=self.counter) if self.key is not None else None
        try:  # the body checked here as the coordinator will (a ValueError if it breaks a bound)
            body = HeartbeatBody(
                node_id=hb.config.node_id,
                address=ident[0],
                budget_bytes=ident[1],
                inventory=inventory,
                workers=workers,
                exited=exited,
                udp=udp,
            )
            # two tries: a server that no longer coordinates names the one that does
            status, raw = await self.servers.coordinator(
                self.http, "POST", "/v1/nodes/heartbeat", attempts=2, json=body.model_dump(exclude_none=True), headers=self.headers
            )
            if status != 200:
                raise ValueError(f"HTTP {status}: {raw[:300].decode(errors='replace')}")
            answer = RingView.model_validate_json(raw)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            hb._exited = exited + hb._exited  # say it again next time
            hb.failed += 1
            if time.monotonic() - hb._last_warning > 10:
                hb._last_warning = time.monotonic()
                log.warning("heartbeat failed", extra={"dataserver": self.servers.leader, "error": str(exc)})
            return
        if self.acked_url != self.servers.leader:
            self.acked_url, self.udp_port, self.udp_addr = self.servers.leader, None, None  # another coordinator: its own UDP port
        hb.sent += 1
        hb.answered_at = time.monotonic()
        self.acked, self.inv_version = (*ident, payload), self.counter
        self._set_view(answer)
        if answer.udp_port != self.udp_port:
            self.udp_port, self.udp_addr = answer.udp_port or None, None

    async def _get_view(self) -> None:
        try:
            status, raw = await self.servers.coordinator(
                self.http, "GET", "/v1/nodes/view", attempts=2, params={"node_id": self.hb.config.node_id}
            )
            if status != 200:
                raise ValueError(f"HTTP {status}: {raw[:300].decode(errors='replace')}")
            self._set_view(RingView.model_validate_json(raw))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            log.warning("cannot fetch the ring view", extra={"dataserver": self.servers.leader, "error": str(exc)})

    def _set_view(self, view: RingView) -> None:
        self.epoch, self.version = view.epoch, view.version
        self.members, self.dead = dict(view.members), set(view.dead)
        succ = view.successor or None  # the coordinator's, from its ring as it is now
        self._publish((succ, view.successor_address if succ else None))

    def _publish(self, sent: tuple[str | None, str | None] | None = None) -> None:
        """The view the replicator reads. The successor is the coordinator's when the answer
        ``sent`` one; a member list brought up to date here from membership events has none, so
        the same rule (``ffplane_contract.ring``) gives it."""
        ring = sorted(self.members)
        if sent is not None:
            succ, address = sent
        else:
            succ = successor(ring, self.hb.config.node_id)
            address = self.members[succ] if succ else None
        self.hb.view = {
            "ring": ring,
            "successor": succ,
            "successor_address": address,
            "dead": sorted(self.dead),
            "members": dict(self.members),
            "version": self.version,
        }
