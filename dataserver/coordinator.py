"""Membership of a job's node daemons: heartbeats, dead-node detection, the replication ring,
and the job-wide restorable step.

Nothing here is persisted: membership is soft state rebuilt from the daemons' heartbeats, so a
restarted data server knows the cluster again after one heartbeat round, without any daemon or
worker restarting. A node silent for ``dead_after_s`` is declared dead by a sweep that runs every
``sweep_s``; the ring is the alive nodes in node-id order, each replicating to its successor.

Two transports feed it (decisions.md, "Heartbeats: UDP liveness, HTTP registration"):

* HTTP ``POST /v1/nodes/heartbeat`` (bearer token): the full heartbeat — address, budget,
  inventory, workers, exited workers. A daemon sends it to register (first beat, after a data
  server restart, after being declared dead), when a worker exited, or when UDP fails. Its answer
  is the whole ring view and the UDP port. A record of it that fails its check (one job's step
  out of range, a role that is no role name: ``dataserver.records``) is dropped and named in the
  answer; the node and its other records are taken.
* UDP datagrams (``ffplane_contract.heartbeat``, HMAC-SHA256 with the job token): liveness of a node
  registered over HTTP, plus — only when it changed — its inventory and workers as a compressed
  blob that is decoded only when someone asks for a job's status. The answer carries the ring
  view's version and, when the daemon's view is behind, the membership events it missed.

A datagram cannot create membership: from a node the coordinator does not know (or knows as dead,
or under another daemon session) it is answered "unknown, send a full heartbeat".

The address a node registers is what its peers will connect to, so the coordinator refuses one
that cannot be: an unspecified host (0.0.0.0, ::), a loopback host from a node that is not on
this host, and the address of another live member (two daemons started without
``--advertise-address`` on two hosts both say http://127.0.0.1:8471). A member dead for
``forget_after_s`` is forgotten, its inventory with it.
"""

from __future__ import annotations

import asyncio
import bisect
import ipaddress
import json
import logging
import os
import socket
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, cast
from urllib.parse import urlsplit

from dataserver.records import DropLog, Drops, check_inventory, check_workers
from ffplane_contract.errors import ConflictError, InvalidError
from ffplane_contract.heartbeat import (
    KIND_INV,
    STATUS_OK,
    STATUS_STALE,
    STATUS_UNKNOWN,
    VIEW_CURRENT,
    VIEW_EVENTS,
    VIEW_FULL,
    Answer,
    Beat,
    decode_inventory,
    encode_events,
)
from ffplane_contract.restorable import Layouts, restorable_step
from ffplane_contract.ring import successor as ring_successor

log = logging.getLogger(__name__)

_MAX_EVENTS = 1024  # membership events kept for view deltas
_MAX_EVENT_BYTES = 6000  # larger deltas: the daemon fetches the whole view (~180 KB at 4,096 nodes)
_VIEW_REFRESH_S = 0.1  # the encoded whole view is rebuilt at most this often (joins come in storms)


_ADVERTISE = "start the daemon with --advertise-address set to an address its peers can reach"


def _host_ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` as an IP address (IPv4 short forms like ``127.1`` and ``0`` included), else None."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            ip = ipaddress.IPv4Address(socket.inet_aton(host))
        except (OSError, ValueError):
            return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _is_loopback(host: str) -> bool:
    ip = _host_ip(host)
    if ip is not None:
        return ip.is_loopback
    host = host.lower().rstrip(".")
    return host in ("localhost", "ip6-localhost", "ip6-loopback") or host.endswith(".localhost")


def address_key(address: str, client_host: str | None = None) -> tuple[str, int]:
    """The ``(host, port)`` peers would connect to at ``address``, or InvalidError if they
    could not: not an http(s) URL with a host, an unspecified host, or a loopback host
    registered by a client that is not itself on loopback (it would name the peer's own host)."""
    try:
        url = urlsplit(address)
        host, port = url.hostname, url.port
    except ValueError as exc:
        raise InvalidError(f"address {address!r} is not a URL ({exc}); expected http://HOST:PORT") from exc
    if url.scheme not in ("http", "https") or not host:
        raise InvalidError(f"address {address!r} is not an http(s)://HOST:PORT URL; {_ADVERTISE}")
    ip = _host_ip(host)
    if ip is not None and ip.is_unspecified:
        raise InvalidError(f"address {address!r} names no host (an unspecified address: the bind-all one?); {_ADVERTISE}")
    if client_host is not None and _is_loopback(host) and not _is_loopback(client_host):
        raise InvalidError(
            f"address {address!r} is a loopback address but the node registers from {client_host}: "
            f"its peers would reach themselves; {_ADVERTISE}"
        )
    return (str(ip) if ip is not None else host.lower().rstrip(".")), port or (443 if url.scheme == "https" else 80)


class Member:
    __slots__ = (
        "_drop_log",
        "_inventory",
        "_raw",
        "_workers",
        "address",
        "address_key",
        "alive",
        "budget_bytes",
        "counter",
        "dead_since",
        "http_beats",
        "inv_version",
        "last_seen",
        "node_id",
        "session",
        "udp_beats",
        "unreachable",
    )

    def __init__(self, node_id: str, address: str, budget_bytes: int, last_seen: float, drop_log: DropLog | None = None) -> None:
        self.node_id = node_id
        self.address = address  # the daemon's ops/peer base URL
        self.address_key = address_key(address)  # (host, port), for the one-member-per-address rule
        self.budget_bytes = budget_bytes
        self.last_seen = last_seen
        self.alive = True
        self.unreachable = False  # beating, but its peer port does not answer: out of the ring until it does
        self.dead_since: float | None = None
        self.session: bytes | None = None  # the daemon process's UDP session, registered over HTTP
        self.counter = 0  # highest message counter seen in that session (replays are dropped)
        self.inv_version = 0
        self.http_beats = self.udp_beats = 0
        self._inventory: dict[str, dict[str, list[dict[str, Any]]]] = {}  # job → role → versions
        self._workers: list[dict[str, Any]] = []
        self._raw: bytes | None = None  # an inventory from a datagram, not decoded yet
        self._drop_log = drop_log or DropLog()  # its records that fail their check, said once

    def set_inventory(self, inventory: dict[str, dict[str, list[dict[str, Any]]]], workers: list[dict[str, Any]]) -> None:
        self._inventory, self._workers, self._raw = inventory, workers, None

    def set_raw(self, raw: bytes) -> None:
        self._raw = raw

    def _decode(self) -> None:
        raw, self._raw = self._raw, None
        if raw is None:
            return
        try:
            inventory, workers = decode_inventory(raw)
        except (ValueError, TypeError, zlib.error) as exc:
            log.warning("malformed inventory datagram ignored", extra={"node": self.node_id, "error": str(exc)})
            self._inventory, self._workers = {}, []
            return
        drops = Drops()  # checked as an HTTP heartbeat's records are: a bad one is dropped, not the rest
        self._inventory, self._workers = check_inventory(inventory, drops), check_workers(workers, "workers", drops)
        if drops.count:
            self._drop_log.note(self.node_id, drops)

    @property
    def inventory(self) -> dict[str, dict[str, list[dict[str, Any]]]]:
        self._decode()
        return self._inventory

    @property
    def workers(self) -> list[dict[str, Any]]:
        self._decode()
        return self._workers


class Coordinator:
    def __init__(
        self, dead_after_s: float = 1.5, token: str | None = None, forget_after_s: float = 600.0, max_members: int = 1 << 16
    ) -> None:
        self.dead_after_s = dead_after_s
        self.forget_after_s = forget_after_s  # a dead member is forgotten after this long
        self.max_members = max_members  # alive and not yet forgotten
        self.key = token.encode() if token else None
        self.udp_port: int | None = None  # set once the UDP listener is bound
        self.on_declared_dead: Callable[[float], None] | None = None  # silence before a node was declared dead
        self.deaths: deque[dict[str, Any]] = deque(maxlen=256)  # nodes declared dead, newest last (the status page)
        self.stats = {"udp_beats": 0, "udp_inventories": 0, "udp_rejected": 0, "udp_unknown": 0, "udp_replayed": 0, "http_beats": 0}
        self.drop_log = DropLog()  # heartbeat records that failed their check (records.py)
        self.reset()

    def reset(self) -> None:
        """Forget every member, under a new view epoch: this server just took over coordination
        (what it knew from an earlier turn is stale) or handed it over. The daemons register
        again with their next full heartbeat."""
        self.members: dict[str, Member] = {}
        self._by_seen: OrderedDict[str, Member] = OrderedDict()  # alive members, least recently seen first
        self._dead_since: OrderedDict[str, float] = OrderedDict()  # dead members, longest dead first
        self._by_address: dict[tuple[str, int], str] = {}  # alive members' (host, port) → node id
        self.worker_exits: list[dict[str, Any]] = []
        # The ring view: a version bumped by every membership event, under a random epoch (a
        # restarted data server starts a new epoch, so no daemon mistakes old versions for new).
        self.epoch = int.from_bytes(os.urandom(8), "big")
        self.version = 0
        self._events: list[list[str]] = []  # the last events; _events[i] took the view from _events_base + i to + i + 1
        self._events_base = 0
        self._ring: list[str] = []  # alive node ids, sorted
        self._view_head: bytes | None = None  # the encoded whole view, at most _VIEW_REFRESH_S old
        self._view_built = -1.0
        self._view_version = 0
        self._deltas: dict[int, bytes | None] = {}

    # ---- membership changes ----

    def _changed(self, event: list[str]) -> None:
        self.version += 1
        self._events.append(event)
        if len(self._events) > _MAX_EVENTS:
            drop = len(self._events) - _MAX_EVENTS
            del self._events[:drop]
            self._events_base += drop
        self._deltas.clear()

    def _seen(self, m: Member, now: float) -> None:
        m.last_seen = now
        self._by_seen[m.node_id] = m
        self._by_seen.move_to_end(m.node_id)

    def heartbeat(
        self,
        node_id: str,
        address: str,
        budget_bytes: int,
        inventory: Any,
        workers: Any,
        exited: Any,
        udp: dict[str, Any] | None = None,
        client_host: str | None = None,
    ) -> Drops:
        """Record a node's full heartbeat (its first one registers it). ``udp`` registers the
        daemon's UDP session: ``{"session": 16 hex digits, "counter": n, "inv_version": v}``.
        ``client_host`` is where the request came from. Raises InvalidError (an address peers
        could not use) or ConflictError (it clashes with another member's address, or the
        membership limit), having changed nothing, when the registration cannot be taken.
        Records of ``inventory``, ``workers`` and ``exited`` that fail their check are left out
        (logged once per node and job) and returned; the rest is applied."""
        drops = Drops()
        inventory = check_inventory(inventory, drops)
        workers, exited = check_workers(workers, "workers", drops), check_workers(exited, "exited", drops)
        now = time.monotonic()
        m = self.members.get(node_id)
        key = address_key(address, client_host)
        owner = self._by_address.get(key)
        if owner is not None and owner != node_id:
            raise ConflictError(
                f"address {address!r} is the address of live node {owner!r}; two nodes cannot share one "
                f"(is this node's daemon started without --advertise-address?)"
            )
        if m is None and len(self.members) >= self.max_members:
            raise ConflictError(
                f"the coordinator holds {len(self.members)} members (alive or dead for under {self.forget_after_s:g} s), its limit"
            )
        if m is None or not m.alive:
            log.info("node joined" if m is None else "node back", extra={"node": node_id, "address": address})
            self._dead_since.pop(node_id, None)
            m = Member(node_id, address, budget_bytes, now, self.drop_log)
            self.members[node_id] = m
            bisect.insort(self._ring, node_id)
            self._by_address[key] = node_id
            self._changed(["+", node_id, address])
        elif m.address != address:
            if self._by_address.get(m.address_key) == node_id:
                del self._by_address[m.address_key]
            self._by_address[key] = node_id
            m.address, m.address_key = address, key
            if m.unreachable:  # a restarted daemon, at a new port: try it again
                m.unreachable = False
                bisect.insort(self._ring, node_id)
            self._changed(["+", node_id, address])
        m.budget_bytes = budget_bytes
        self._seen(m, now)
        m.set_inventory(inventory, workers)
        m.http_beats += 1
        self.stats["http_beats"] += 1
        if udp is not None:
            session = bytes.fromhex(udp["session"])
            m.counter = max(m.counter, int(udp["counter"])) if m.session == session else int(udp["counter"])
            m.session, m.inv_version = session, int(udp["inv_version"])
        for w in exited:
            log.info("worker exited", extra={"worker": w, "node": node_id})  # a crash or the end of the job: the daemon cannot tell
            self.worker_exits.append({**w, "node": node_id, "at": time.time()})
        del self.worker_exits[:-256]
        if drops.count:
            self.drop_log.note(node_id, drops)
        return drops

    def expect(self, members: dict[str, str], grace_s: float) -> list[str]:
        """Members another coordinator had alive (node id → address), taken on after it went: each
        is in the ring until it has been silent ``grace_s + dead_after_s``, so a node lost in the
        hand-over is still declared dead; one that registered already is left as it is. Returns
        those added."""
        seen = time.monotonic() + grace_s
        added = []
        for node_id, address in sorted(members.items()):
            if node_id in self.members or len(self.members) >= self.max_members:
                continue
            try:
                m = Member(node_id, address, 0, seen, self.drop_log)
            except InvalidError:
                continue
            if m.address_key in self._by_address:
                continue
            self.members[node_id] = m
            bisect.insort(self._ring, node_id)
            self._by_address[m.address_key] = node_id
            self._by_seen[node_id] = m  # its future last_seen can hold back a sweep by grace_s at most
            self._changed(["+", node_id, address])
            added.append(node_id)
        return added

    def beat(self, b: Beat) -> Answer | None:
        """An authenticated UDP beat; returns the answer, or None to stay silent."""
        m = self.members.get(b.node_id)
        if m is None or not m.alive or m.session != b.session:
            self.stats["udp_unknown"] += 1
            return Answer(STATUS_UNKNOWN, VIEW_CURRENT, b.counter, self.epoch, self.version)
        if b.counter <= m.counter:
            self.stats["udp_replayed"] += 1
            return None
        m.counter = b.counter
        self._seen(m, time.monotonic())
        m.udp_beats += 1
        self.stats["udp_beats"] += 1
        status = STATUS_OK
        if b.kind == KIND_INV:
            m.set_raw(b.payload)
            m.inv_version = b.inv_version
            self.stats["udp_inventories"] += 1
        elif b.inv_version != m.inv_version:
            status = STATUS_STALE
        if b.epoch == self.epoch and b.view_version == self.version:
            return Answer(status, VIEW_CURRENT, b.counter, self.epoch, self.version)
        events = self._delta(b.view_version) if b.epoch == self.epoch else None
        return Answer(status, VIEW_FULL if events is None else VIEW_EVENTS, b.counter, self.epoch, self.version, events or b"")

    def _delta(self, since: int) -> bytes | None:
        """The encoded events from view version ``since`` to now, or None if gone or too big."""
        if since in self._deltas:
            return self._deltas[since]
        out = None
        if self._events_base <= since < self.version:
            out = encode_events(self._events[since - self._events_base :])
            if len(out) > _MAX_EVENT_BYTES:
                out = None
        self._deltas[since] = out
        return out

    def sweep(self) -> list[str]:
        """Declare nodes silent for too long dead; returns those newly declared. Only the least
        recently seen members are looked at, so a sweep costs O(newly dead), not O(members)."""
        now = time.monotonic()
        limit = now - self.dead_after_s
        newly = []
        while self._by_seen:
            m = next(iter(self._by_seen.values()))
            if m.last_seen >= limit:
                break
            self._by_seen.popitem(last=False)
            if not m.unreachable:  # an unreachable member is out of the ring already
                del self._ring[bisect.bisect_left(self._ring, m.node_id)]
            m.alive, m.dead_since, m.unreachable = False, now, False
            if self._by_address.get(m.address_key) == m.node_id:
                del self._by_address[m.address_key]
            self._dead_since[m.node_id] = now
            newly.append(m.node_id)
            self._changed(["-", m.node_id])
            log.warning("node declared dead", extra={"node": m.node_id, "silent_s": round(now - m.last_seen, 3)})
            self.deaths.append({"node": m.node_id, "at": time.time(), "silent_s": round(now - m.last_seen, 3)})
            if self.on_declared_dead is not None:
                self.on_declared_dead(now - m.last_seen)  # the detection latency, for /metrics
        forget = now - self.forget_after_s
        while self._dead_since:
            node_id, since = next(iter(self._dead_since.items()))
            if since >= forget:
                break
            self._dead_since.popitem(last=False)
            gone = self.members.get(node_id)
            if gone is not None and not gone.alive:
                del self.members[node_id]
                self._view_head = None  # the whole view's dead list drops it (no event: it was dead)
                log.info("dead node forgotten", extra={"node": node_id, "dead_s": round(now - since, 3)})
        return newly

    def set_unreachable(self, node_id: str, unreachable: bool) -> bool:
        """Take a live member that beats but whose peer port does not answer out of the ring (its
        predecessor then replicates past it), or put it back; whether anything changed."""
        m = self.members.get(node_id)
        if m is None or not m.alive or m.unreachable == unreachable:
            return False
        m.unreachable = unreachable
        if unreachable:
            del self._ring[bisect.bisect_left(self._ring, node_id)]
            self._changed(["-", node_id])
            log.warning("node unreachable: out of the ring until it answers", extra={"node": node_id, "address": m.address})
        else:
            bisect.insort(self._ring, node_id)
            self._changed(["+", node_id, m.address])
            log.info("node reachable again: back in the ring", extra={"node": node_id, "address": m.address})
        return True

    def unreachable(self) -> dict[str, str]:
        """Unreachable members and their addresses (to probe again)."""
        return {n: m.address for n, m in self.members.items() if m.alive and m.unreachable}

    # ---- the ring view ----

    def ring(self) -> list[str]:
        return list(self._ring)

    def successor(self, node_id: str) -> str | None:
        return ring_successor(self._ring, node_id)  # the rule the daemons apply too

    def dead(self) -> list[str]:
        return sorted(n for n, m in self.members.items() if not m.alive)

    def view(self, node_id: str | None = None) -> dict[str, Any]:
        """The ring view: ring, alive members' addresses, dead nodes, and ``node_id``'s successor."""
        succ = self.successor(node_id) if node_id else None
        return {
            "epoch": self.epoch,
            "version": self.version,
            "ring": self.ring(),
            "members": {n: self.members[n].address for n in self.ring()},
            "dead": self.dead(),
            "successor": succ,
            "successor_address": self.members[succ].address if succ else None,
            "udp_port": self.udp_port,
        }

    def view_bytes(self, node_id: str | None = None) -> bytes:
        """``view(node_id)`` as JSON. The part shared by every node is encoded at most every
        ``_VIEW_REFRESH_S`` (so a storm of joins does not encode it once per join): it may be
        that much behind, consistently with the version it names, and the node's next beats
        bring it the events since."""
        now = time.monotonic()
        if self._view_head is None or (self._view_version != self.version and now - self._view_built >= _VIEW_REFRESH_S):
            self._view_built, self._view_version = now, self.version
            ring = self._ring
            head = {
                "epoch": self.epoch,
                "version": self.version,
                "ring": ring,
                "members": {n: self.members[n].address for n in ring},
                "dead": self.dead(),
            }
            self._view_head = json.dumps(head, separators=(",", ":")).encode()[:-1]
        succ = self.successor(node_id) if node_id else None
        tail = {"successor": succ, "successor_address": self.members[succ].address if succ else None, "udp_port": self.udp_port}
        return self._view_head + b"," + json.dumps(tail, separators=(",", ":")).encode()[1:]

    def newest_step(self, job: str) -> int | None:
        """The newest step of ``job`` any member (alive or dead) has reported a committed shard of."""
        newest: int | None = None
        for m in self.members.values():
            for versions in m.inventory.get(job, {}).values():
                for v in versions:
                    step = v.get("step") if isinstance(v, dict) else None
                    if type(step) is int and (newest is None or step > newest):
                        newest = step
        return newest

    def status(self, job: str) -> dict[str, Any]:
        """Members, ring, dead nodes, where each role's shards are, and the restorable step."""
        locations: dict[str, dict[int, list[str]]] = {}
        anywhere: dict[str, set[int]] = {}  # alive or dead: had the job a whole step at all?
        layouts = Layouts()  # a dead node's copy still names its step's layout
        for m in self.members.values():
            for role, versions in m.inventory.get(job, {}).items():
                for v in versions:
                    try:
                        step, peers = int(v["step"]), [str(r) for r in v.get("layout_roles", [role])]
                    except (KeyError, TypeError, ValueError):
                        log.warning("malformed inventory entry ignored", extra={"node": m.node_id, "job": job, "role": role})
                        continue
                    if m.alive and not m.unreachable:  # nobody can pull from an unreachable node
                        locations.setdefault(role, {}).setdefault(step, []).append(m.node_id)
                    anywhere.setdefault(role, set()).add(step)
                    layouts.add(step, peers)
        restorable = restorable_step(locations, layouts)
        return {
            "job": job,
            "members": {
                n: {
                    "address": m.address,
                    "alive": m.alive and not m.unreachable,
                    "unreachable": m.unreachable,
                    "budget_bytes": m.budget_bytes,
                    "workers": m.workers,
                    "silent_s": round(time.monotonic() - m.last_seen, 3),
                }
                for n, m in sorted(self.members.items())
            },
            "ring": self.ring(),
            "dead": self.dead(),
            "restorable_step": restorable,
            # None: no step of the job was ever committed by every role on the members known here
            # (a first step some ranks never reached), so a restore with nothing whole starts fresh
            "whole_step_anywhere": restorable_step(anywhere, layouts),
            "roles": sorted(set().union(*layouts.roles.values())),
            "layouts": {str(s): sorted(roles) for s, roles in sorted(layouts.roles.items())},
            "shard_locations": {r: {str(s): nodes for s, nodes in sorted(steps.items())} for r, steps in sorted(locations.items())},
            "worker_exits": [w for w in self.worker_exits if w.get("job") in (None, job)][-32:],
        }


class HeartbeatProtocol(asyncio.DatagramProtocol):
    """The coordinator's UDP listener: authenticates each datagram and answers it."""

    def __init__(self, coordinator: Coordinator) -> None:
        assert coordinator.key is not None, "UDP heartbeats need the job token"
        self.coordinator = coordinator
        self.key: bytes = coordinator.key
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)  # uvloop's is not a subclass

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        beat = Beat.decode(self.key, data)
        if beat is None:
            self.coordinator.stats["udp_rejected"] += 1
            return
        answer = self.coordinator.beat(beat)
        if answer is not None and self.transport is not None:
            self.transport.sendto(answer.encode(self.key), addr)

    def error_received(self, exc: Exception) -> None:  # e.g. an ICMP error for an earlier answer
        pass


async def listen_udp(coordinator: Coordinator, host: str, port: int, rcvbuf: int = 4 << 20) -> asyncio.DatagramTransport:
    """Bind the heartbeat listener (``port`` 0: any free port) and record its port."""
    import socket

    loop = asyncio.get_running_loop()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        # a round of 4,096 beats must fit while the loop is busy elsewhere; the kernel caps this at
        # net.core.rmem_max
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"cannot listen for UDP heartbeats on {host}:{port}: {exc}") from exc
    transport, _ = await loop.create_datagram_endpoint(lambda: HeartbeatProtocol(coordinator), sock=sock)
    coordinator.udp_port = sock.getsockname()[1]
    log.info(
        "listening for UDP heartbeats",
        extra={"host": host, "port": coordinator.udp_port, "rcvbuf": sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)},
    )
    return transport
