"""The ring policy: every commit of a role saving here goes to the ring successor (the
coordinator's ``view``), newest first; a commit's answer waits until the successor holds the
version ``max_lag - 1`` commits back; a ring change sends again whatever may have lost its copy;
a successor that beats but takes no connection is reported. The bytes move through a
``Transport`` (``statestore.transport``), whichever carries them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from ffplane_contract.ring import parity_holder
from statestore import retention
from statestore.heartbeat import Heartbeat
from statestore.replicas import ReplicaStore
from statestore.shard import LocalShard, find_local
from statestore.slots import SlotStore
from statestore.transport.base import PeerError, Transport

log = logging.getLogger(__name__)

# How long a node that had a ring successor and lost it (the ring is just this node) still holds
# commits back for one to reappear. Two ways a live successor vanishes for a moment, both found by
# the soak, both leaving commits answered then with no copy anywhere else: a restarted data
# server's coordinator, which has not heard from it yet (membership is soft state, rebuilt from
# the next beats), and a false death (silent for 1.5 s under load, back on its next beat).
# Longer than either; short enough that a job left on one node for good runs on, unreplicated
# (logged). docs/decisions.md "A successor gone for a moment".
_ALONE_GRACE_S = 5.0
_REPORT_DOWN_S = 2.0  # a successor refusing connections this long is reported to the coordinator


class Replicator:
    """Pushes every newly committed shard to the ring successor; re-replicates on ring changes."""

    def __init__(
        self,
        node_id: str,
        slots: SlotStore,
        replicas: ReplicaStore,
        heartbeat: Heartbeat,
        transport: Transport,
        max_lag: int = 1,
        wait_s: float = 30.0,
        quarantine: Callable[[LocalShard], None] = lambda shard: None,
        observe_push: Callable[[float], None] = lambda seconds: None,
        parity_k: int = 0,
    ) -> None:
        self.node_id = node_id
        self.parity_k = parity_k  # > 0: push to the group's parity holder (statestore.parity), not the successor
        self._observe_push = observe_push  # each push's duration, for the daemon's histogram
        self._quarantine = quarantine  # drops a copy held here that is found corrupt (``CorruptCopies.quarantine``)
        self.max_lag, self.wait_s = max_lag, wait_s
        self.slots, self.replicas, self.heartbeat, self.transport = slots, replicas, heartbeat, transport
        self._pending: dict[tuple[str, str], set[int]] = {}  # (job, role) → steps to push
        self._held: set[tuple[str, str, int]] = set()  # replicas we forward (their primary died)
        self._again: set[tuple[str, str, int]] = set()  # sent before a ring change: the successor may hold them
        self._fresh: set[tuple[str, str, int]] = set()  # committed here since the last push of it: may claim the newest step
        self._commits: dict[tuple[str, str], int] = {}  # per role, since this daemon started
        self._wake = asyncio.Event()
        self.successor: str | None = None
        self._alone_since: float | None = None  # when the ring shrank to this node alone
        self._warned_alone = False
        self._ring: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
        self.replicated: dict[tuple[str, str], tuple[int, str]] = {}  # newest step pushed, and where
        self._progress = asyncio.Event()  # set (and replaced) whenever ``replicated`` moves
        self._awaited: dict[tuple[str, str], int] = {}  # a commit waits for this step's replica
        self.bytes_sent = 0
        self.pushes = self.failures = 0
        self.commit_waits = self.commit_wait_timeouts = 0
        self.commit_wait_s = 0.0
        self.last_error = ""
        self.refusals = 0  # pushes the successor refused for want of room (413/507): retrying cannot help soon
        self._refused: dict[tuple[str, str], tuple[int, str, str]] = {}  # role → (step, successor, why) refused
        self._down = False  # the last failure was a connection that could not be made
        self._down_since: tuple[str, float, float] | None = None  # (successor, since, last reported)

    def committed(self, job: str, role: str, step: int) -> None:
        self._commits[(job, role)] = self._commits.get((job, role), 0) + 1
        if self.successor is None:
            return  # nowhere to push (it would only pile up): a new successor gets every newest version (_ring_changed)
        self._pending.setdefault((job, role), set()).add(step)
        self._fresh.add((job, role, step))
        self._wake.set()

    async def until_replicated(self, job: str, role: str, step: int) -> None:
        """Called once ``step`` is committed, before the worker hears so: wait until the
        successor holds the version ``max_lag - 1`` commits back (``step`` itself by default).
        The worker's next all-reduce waits for that answer (``LinkHints.ddp_comm_hook``), so a
        node that dies having finished step T's all-reduce leaves a replica of T-1, which the
        survivors' kept versions include: at most one lost step (docs/decisions.md, "Replica
        lag is bounded"). The push had the next step's forward pass to run in, so this rarely
        waits; the awaited push passes TRAIN's signals. At most ``wait_s`` (a successor that
        stops answering is declared dead and replaced well within it), then it logs that the
        bound does not hold."""
        rs = self.slots.roles.get((job, role))
        if self.max_lag <= 0 or rs is None or self._no_peer():
            return
        versions = sorted((s for s in rs.versions if s <= step), reverse=True)
        if len(versions) < self.max_lag:
            return
        need = versions[self.max_lag - 1]
        started = time.monotonic()
        self._awaited[(job, role)] = need
        self._wake.set()
        try:
            while not self._holds(job, role, need):
                if self._no_peer():
                    return  # no peer to replicate to: nothing to wait for
                refused = self._refused.get((job, role))
                if refused is not None and refused[0] >= need and refused[1] == self.successor:
                    self.commit_wait_timeouts += 1  # answered without the bound, as a timeout is, but at once
                    log.warning(
                        "the successor has no room for the replica; answering the commit without it",
                        extra={"job": job, "role": role, "step": step, "to": self.successor, "error": refused[2]},
                    )
                    return
                left = self.wait_s - (time.monotonic() - started)
                if left <= 0:
                    self.commit_wait_timeouts += 1
                    log.warning(
                        "replica still behind; answering the commit anyway",
                        extra={"job": job, "role": role, "step": step, "replica_needed": need, "to": self.successor},
                    )
                    return
                try:
                    await asyncio.wait_for(self._progress.wait(), timeout=min(left, 0.5))
                except asyncio.TimeoutError:
                    pass
        finally:
            self._awaited.pop((job, role), None)
            waited = time.monotonic() - started
            if waited > 0.001:
                self.commit_waits += 1
                self.commit_wait_s += waited

    def target(self, view: dict[str, Any]) -> tuple[str | None, str | None]:
        """Where commits go, and its address: the ring successor, or with parity replicas the
        holder of this node's group's parity (``ffplane_contract.ring.parity_holder``)."""
        if not self.parity_k:
            return view.get("successor"), view.get("successor_address")
        holder = parity_holder(sorted(view.get("ring", [])), self.node_id, self.parity_k)
        return holder, view.get("members", {}).get(holder) if holder else None

    def _no_peer(self) -> bool:
        return self.successor is None and self.heartbeat.view.get("successor") is None and not self._waits_for_a_peer()

    def _waits_for_a_peer(self) -> bool:
        """Alone in the ring: whether a successor may be back soon (see ``_ALONE_GRACE_S``). A
        node that never had one (a single-node job) does not wait at all."""
        if self._alone_since is None:
            return False
        if time.monotonic() - self._alone_since < _ALONE_GRACE_S:
            return True
        if not self._warned_alone:
            self._warned_alone = True
            log.warning(
                "no ring successor for a while: commits are answered without a replica on another node",
                extra={"alone_s": round(time.monotonic() - self._alone_since, 1)},
            )
        return False

    def _holds(self, job: str, role: str, step: int) -> bool:
        done = self.replicated.get((job, role))
        return done is not None and done[0] >= step and done[1] == self.successor

    def _ring_changed(self, view: dict[str, Any]) -> None:
        """Everything whose copy may have gone: our newest versions (as many as a replica keeps
        while the next one arrives), and the replicas we hold for a primary that died (their only copy is now ours).
        A version this successor has had before may be there still (a change elsewhere in the
        ring, a view that caught up late): ``push`` asks before sending it again."""
        dead = set(view.get("dead", []))
        again = [
            (rs.job, rs.role, v.step)
            for rs in self.slots.roles.values()
            for v in rs.newest(retention.kept_while_writing(self.slots.versions, settled=False))
        ]
        for (job, role), versions in self.replicas.complete.items():
            for r in versions.values():
                if r.source in dead and r.kind == "replica":
                    self._held.add((job, role, r.step))
                    again.append((job, role, r.step))
        for job, role, step in again:
            steps = self._pending.setdefault((job, role), set())
            done = self.replicated.get((job, role))
            if step not in steps and done is not None and done[0] >= step and done[1] == self.successor:
                self._again.add((job, role, step))  # pushed there already (newest first: this one too)
            steps.add(step)

    async def run(self) -> None:
        backoff = 0.2
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            view = self.heartbeat.view
            succ, addr = self.target(view)
            ring = (tuple(view.get("ring", [])), tuple(view.get("dead", [])))
            if ring != self._ring or succ != self.successor:  # (a view's successor may be newer than its member list)
                if succ != self.successor:
                    log.info("replication target changed", extra={"from": self.successor, "to": succ})
                    if succ is None and self.successor is not None:
                        self._alone_since, self._warned_alone = time.monotonic(), False
                    elif succ is not None:
                        self._alone_since = None
                self.successor, self._ring = succ, ring
                self._down_since = None  # a new ring: a successor's earlier silence no longer counts
                if succ is not None:
                    self._ring_changed(view)
            if succ is None or not addr or not self._pending:
                continue
            started = time.monotonic()
            try:
                ok = await self._drain(succ, addr)
            except Exception as exc:  # noqa: BLE001 - one bad shard must not end replication for the node
                log.exception("replication round failed; retrying", extra={"to": succ})
                self.failures += 1
                self.last_error = repr(exc)
                ok = False
            if ok:
                backoff = 0.2
                self._down_since = None
            elif self._down:
                await self._report_down(succ, started)
            if not ok:
                await asyncio.sleep(backoff)  # the successor may be restarting: keep trying
                backoff = min(backoff * 2, 2.0)
                self._wake.set()

    async def _drain(self, succ: str, addr: str) -> bool:
        # a version a commit waits for first, then newest first: the restorable step needs every
        # role's newest version
        work = sorted(
            ((step, job, role) for (job, role), steps in self._pending.items() for step in steps),
            key=lambda w: ((w[1], w[2]) in self._awaited, w[0]),
            reverse=True,
        )
        for step, job, role in work:
            if self.target(self.heartbeat.view)[0] != succ:
                return True  # re-plan against the new ring
            shard = find_local(self.slots, self.replicas, job, role, step)
            if shard is None or (shard.kind != "primary" and (job, role, step) not in self._held):
                self._discard(job, role, step)
                continue
            started = time.perf_counter()
            try:
                sent = await self.transport.push(
                    addr,
                    shard,
                    self.node_id,
                    # only the primary may say which of the role's steps are its newest: a held
                    # replica re-sent after its primary died has older steps than the successor may
                    # already hold from that primary, and claiming them as newest made the
                    # successor drop the newer ones as a rewound future (19 steps lost, the spare
                    # benchmark). Nor may a primary copy re-sent after a ring change: a node that
                    # no longer runs the role (its ranks moved at a rank-0 loss) still holds it,
                    # and its claim made the new successor drop the newer replicas the role's
                    # new primary had pushed there (30 steps lost after a spare takeover). Only
                    # a fresh commit speaks for the role's present.
                    max(self._local_steps(job, role, shard.kind)) if shard.kind == "primary" and (job, role, step) in self._fresh else None,
                    lambda: self._urgent(job, role),
                    maybe_there=(job, role, step) in self._again,
                )
            except PeerError as exc:
                if (exc.conflict or exc.corrupt) and not shard.current():
                    # superseded here (a newer version is queued); a slot reused while it was
                    # being sent arrives torn, and the receiver's checksum says so
                    self._discard(job, role, step)
                    continue
                if exc.corrupt and not await asyncio.to_thread(shard.intact):
                    self._quarantine(shard)  # the receiver found it corrupt, and so do we: sending it again cannot help
                    self._discard(job, role, step)
                    continue
                self.failures += 1
                self.last_error = str(exc)
                self._down = exc.unreachable
                if exc.status in (413, 507):  # no room there: a commit waiting for this replica is told now, not in wait_s
                    self.refusals += 1
                    self._refused[(job, role)] = (step, succ, str(exc))
                    self._progress.set()
                    self._progress = asyncio.Event()
                log.warning(
                    "replication failed; will resume", extra={"job": job, "role": role, "step": step, "to": succ, "error": str(exc)}
                )
                return False
            self._discard(job, role, step)
            self._refused.pop((job, role), None)
            self.bytes_sent += sent
            self.pushes += 1
            self._observe_push(time.perf_counter() - started)
            newest = self.replicated.get((job, role))
            if newest is None or newest[0] <= step or newest[1] != succ:
                self.replicated[(job, role)] = (step, succ)
                self._progress.set()
                self._progress = asyncio.Event()
            log.debug(  # every push, every step: counted in /v1/state and /metrics
                "replicated",
                extra={
                    "job": job,
                    "role": role,
                    "step": step,
                    "to": succ,
                    "bytes": sent,
                    "seconds": round(time.perf_counter() - started, 4),
                },
            )
        return True

    async def _report_down(self, succ: str, tried_at: float) -> None:
        """A successor that beats but takes no connection holds every commit's answer until the
        wait runs out: after ``_REPORT_DOWN_S`` of that, tell the coordinator, which checks and
        moves the ring past it (then the new successor gets the newest versions)."""
        now = time.monotonic()
        if self._down_since is None or self._down_since[0] != succ:
            self._down_since = (succ, tried_at, 0.0)  # a connect that timed out has waited already
        _, since, reported = self._down_since
        if now - since < _REPORT_DOWN_S or now - reported < _REPORT_DOWN_S:
            return
        self._down_since = (succ, since, now)
        log.warning(
            "ring successor unreachable: reported to the coordinator",
            extra={"successor": succ, "unreachable_s": round(now - since, 1), "error": self.last_error},
        )
        await self.heartbeat.report_unreachable(succ)

    def _urgent(self, job: str, role: str) -> bool:
        """Whether a push may pass TRAIN's signals (it is still counted as replication). The gate
        may delay replication while TRAIN runs, but not when a commit's answer — and so a worker's
        next all-reduce, which its peers are waiting in — waits for a replica: then every push
        ahead of that one goes too. Nor once a role's replica trails by more than ``max_lag``
        commits (found by the demo, whose collectives keep the link busy nearly all the time)."""
        if self.max_lag <= 0:
            return False
        if self._awaited:
            return True
        rs = self.slots.roles.get((job, role))
        if rs is None or not rs.versions:
            return False
        done = self.replicated.get((job, role))
        lag = self._commits.get((job, role), 0) if done is None else max(rs.versions) - done[0]
        return lag > self.max_lag

    def _local_steps(self, job: str, role: str, kind: str) -> set[int]:
        if kind == "primary":
            rs = self.slots.roles.get((job, role))
            return set(rs.versions) if rs else set()
        return set(self.replicas.complete.get((job, role), {}))

    def _discard(self, job: str, role: str, step: int) -> None:
        self._again.discard((job, role, step))
        self._fresh.discard((job, role, step))
        steps = self._pending.get((job, role))
        if steps is not None:
            steps.discard(step)
            if not steps:
                del self._pending[(job, role)]

    def pending(self) -> int:
        return sum(len(s) for s in self._pending.values())

    def describe(self) -> dict[str, Any]:
        lag = {}
        for rs in self.slots.roles.values():
            newest = rs.newest(1)
            done = self.replicated.get((rs.job, rs.role))
            if newest:
                lag[f"{rs.job}/{rs.role}"] = {
                    "committed": newest[0].step,
                    "replicated": done[0] if done else None,
                    "to": done[1] if done else None,
                }
        return {
            "successor": self.successor,
            "pending": self.pending(),
            "bytes_sent": self.bytes_sent,
            "pushes": self.pushes,
            "pushes_in_one_request": self.transport.counts.in_one_request,
            "pushes_resumed": self.transport.counts.resumed,
            "pushes_already_there": self.transport.counts.already_there,
            "failures": self.failures,
            "commit_waits": self.commit_waits,
            "commit_wait_seconds": round(self.commit_wait_s, 3),
            "commit_wait_timeouts": self.commit_wait_timeouts,
            "refused_for_room": self.refusals,
            "last_error": self.last_error or None,
            "roles": lag,
        }
