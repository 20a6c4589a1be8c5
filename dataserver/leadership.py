"""Which data server coordinates: the holder of an etcd lease on ``/ffplane/leader``.

Every data server of a deployment serves plans and batches; exactly one at a time also runs the
coordinator (node heartbeats, dead-node verdicts, the ring, restore status). The leader key holds
the leader's advertised URL under a lease it renews every third of the TTL; when the process dies
or loses etcd, the lease expires and the first follower to see the key gone creates it under its
own lease (a create-if-absent transaction, so exactly one wins). A leader that cannot renew for
two thirds of the TTL steps down by itself, before etcd lets another take over, so two servers
never coordinate at once for longer than a clock's drift. The election is etcd's lease and
transaction, not ours (decisions.md, "Several data servers: records in etcd, one coordinator
by lease").

The lead belongs to a process, not to a URL: a server holds it only under its own lease. Two
servers given the same ``--advertise-url`` both took the key whenever it named "their" URL,
each over the other's lease, and both coordinated, flipping every renewal. Now a key naming this
server's URL under another lease is left alone: an earlier run of this server, killed before it
could hand over, leaves a lease that runs out within the TTL; a lease still renewed past that is
another live process with the same URL. ``dataserver serve`` refuses to start then
(``twin_leads``); a server that finds it later stays a follower and says so once, as an error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ffplane_runtime.etcd import Etcd, EtcdUnavailable

log = logging.getLogger(__name__)

LEADER_KEY = b"/ffplane/leader"
LEASE_TTL_S = 2  # etcd's lease: a dead leader is replaced within this plus one poll
_POLL_S = 0.2  # how often a follower looks at the leader key
_TWIN_MARGIN_S = 1.0  # past a lease's TTL, for etcd to delete the keys of one that ran out


class _Twin:
    """Watches the leader key naming this server's URL under a lease not its own: whether that
    lease outlives its TTL (renewed: a live process), rather than running out (an earlier run)."""

    def __init__(self, ttl_s: int) -> None:
        self._ttl_s = ttl_s
        self._lease: int | None = None
        self._since = 0.0

    def alive(self, lease: int) -> bool:
        """Whether ``lease``, seen now, has been seen for longer than it could live unrenewed."""
        now = time.monotonic()
        if lease != self._lease:
            self._lease, self._since = lease, now
        return now - self._since > self._ttl_s + _TWIN_MARGIN_S


def twin_leads(etcd: Etcd, url: str, ttl_s: int = LEASE_TTL_S) -> bool:
    """Blocking, before a server at ``url`` starts: whether another live process coordinates under
    ``url``. Waits, at most the lease's TTL and a margin, for a lease of an earlier run to run out."""
    twin = _Twin(ttl_s)
    while True:
        kv = etcd.get(LEADER_KEY)
        if kv is None or kv.value.decode() != url or not kv.lease:  # a key without a lease is no process's
            return False
        if twin.alive(kv.lease):
            return True
        time.sleep(_POLL_S)


def twin_refusal(url: str) -> str:
    """What a server says when another live process coordinates under its URL ``url``."""
    return (
        f"another data server already coordinates under this server's URL {url} (the etcd key {LEADER_KEY.decode()} names it "
        "under a lease that is not this process's): each data server needs its own --advertise-url"
    )


class Leadership:
    """Campaigns for, holds and gives up ``LEADER_KEY`` for the server at ``url``.

    ``on_change(leading, took_over)`` runs on the event loop each time this server gains or loses
    the lead; ``took_over``: another server (or an earlier run of this one) led before it, so the
    daemons have been coordinated and are still finding the new coordinator.
    """

    def __init__(self, etcd: Etcd, url: str, on_change: Callable[[bool, bool], None], ttl_s: int = LEASE_TTL_S) -> None:
        self._etcd, self.url, self._on_change, self._ttl_s = etcd, url, on_change, ttl_s
        self.leading = False
        self.leader: str | None = None  # the URL in the leader key, as last read
        self._lease = 0
        self._renewed = 0.0
        self._seen_leader = False  # whether any leader key was seen before this server led
        self._twin = _Twin(ttl_s)
        self._twin_told = 0  # the twin's lease, once this server has said so

    def _campaign(self) -> bool:
        """Blocking: take the key if it is free, or still held under this process's own lease
        (after a renewal too late to keep leading). Whether this server leads now."""
        kv = self._etcd.get(LEADER_KEY, retry_s=1.0)
        self._seen_leader |= kv is not None
        if kv is not None:
            self.leader = kv.value.decode()
            if self.leader != self.url:
                return False
            if kv.lease and kv.lease != self._lease:  # this URL, but another process's lease
                self._another_process(kv.lease)
                return False
        lease, _ = self._etcd.grant(self._ttl_s)
        rev, current = self._etcd.cas(LEADER_KEY, self.url.encode(), kv.mod_revision if kv is not None else 0, lease)
        if rev is None:
            self._etcd.revoke(lease)
            self.leader = current.value.decode() if current is not None else None
            return False
        self._lease, self._renewed, self.leader = lease, time.monotonic(), self.url
        return True

    def _another_process(self, lease: int) -> None:
        """The key names this URL under ``lease``, not this process's: left alone. Said once, as an
        error, when that lease outlives its TTL (a live process, not an earlier run of this one)."""
        if self._twin.alive(lease) and self._twin_told != lease:
            self._twin_told = lease
            log.error("%s; this one stays a follower", twin_refusal(self.url), extra={"url": self.url, "lease": f"{lease:x}"})

    def _renew(self) -> bool:
        """Blocking: keep the lease; False once it is lost or cannot be renewed in time."""
        left = self._renewed + self._ttl_s * 2 / 3 - time.monotonic()
        if left <= 0:
            return False
        if self._etcd.keepalive(self._lease, retry_s=left) <= 0:
            return False
        kv = self._etcd.get(LEADER_KEY, retry_s=max(0.1, left))
        if kv is None or kv.lease != self._lease:  # deleted by hand, or taken after an expiry (or by a twin)
            return False
        self._renewed = time.monotonic()
        return True

    def _set(self, leading: bool) -> None:
        if leading != self.leading:
            self.leading = leading
            log.info("coordinating" if leading else "not coordinating", extra={"url": self.url, "leader": self.leader})
            self._on_change(leading, self._seen_leader)

    async def start(self) -> None:
        """One campaign before the server answers, so a lone server leads from its first request."""
        try:
            self._set(await asyncio.to_thread(self._campaign))
        except (EtcdUnavailable, ValueError) as exc:
            log.warning("cannot campaign for coordination; retrying", extra={"error": str(exc)})

    async def run(self) -> None:
        while True:
            try:
                if self.leading:
                    await asyncio.sleep(self._ttl_s / 3)
                    if not await asyncio.to_thread(self._renew):
                        log.warning("coordination lease lost; stepping down", extra={"url": self.url})
                        self._set(False)
                else:
                    await asyncio.sleep(_POLL_S)
                    self._set(await asyncio.to_thread(self._campaign))
            except (EtcdUnavailable, ValueError) as exc:
                if self.leading and time.monotonic() - self._renewed > self._ttl_s * 2 / 3:
                    self._set(False)
                log.warning("etcd unavailable to the leadership loop", extra={"error": str(exc)})
                await asyncio.sleep(_POLL_S)

    async def resign(self) -> None:
        """Hand the lead over now (a clean stop): followers take it at their next poll."""
        if self.leading and self._lease:
            self.leading = False
            await asyncio.to_thread(self._etcd.revoke, self._lease)
