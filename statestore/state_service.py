"""The state half of the daemon: slots, commits, replication, the durable tier and the
restorable step — local, or job-wide through the coordinator, pulling what is not here."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from ffplane_contract import durable
from ffplane_contract.auth import bearer
from ffplane_contract.errors import CorruptError, FFPlaneError, NotFoundError, SlotBusyError, UnavailableError
from ffplane_contract.restorable import Layouts, whole_steps
from ffplane_contract.shard import layout_roles
from statestore.dataservers import DataServers
from statestore.durable import write_shard
from statestore.latencies import Latencies
from statestore.link_gate import LinkGate, Priority
from statestore.replicas import ReplicaStore
from statestore.ring import Replicator
from statestore.shard import CorruptCopies, LocalShard, find_local
from statestore.slots import SlotStore, Version
from statestore.transport.base import Transport

log = logging.getLogger(__name__)


@dataclass
class DurableConfig:
    directory: Path | None = None
    every: int = 0  # steps; 0 = off

    def due(self, step: int) -> bool:
        return self.directory is not None and self.every > 0 and step % self.every == 0


_SETTLE_WAIT_S = 5.0  # how long a restore waits for a data server that just took over coordination


class StateService:
    def __init__(
        self,
        root: Path,
        slots: SlotStore,
        replicas: ReplicaStore,
        durable_cfg: DurableConfig,
        *,
        node_id: str,
        transport: Transport,
        corrupt: CorruptCopies,
        replicator: Replicator | None = None,
        gate: LinkGate | None = None,
        dataservers: DataServers | None = None,
        token: str | None = None,
        latencies: Latencies | None = None,
    ) -> None:
        """``transport`` pulls what a restore needs from other nodes; ``corrupt`` is shared with
        ``replicator`` (none: commits are not replicated); ``gate``: durable copies wait at it
        too (the directory may be remote); ``dataservers``: where the coordinator is, for
        job-wide restores (none: restores from this node only)."""
        self.root, self.node_id = root, node_id
        self.slots, self.replicas, self.durable = slots, replicas, durable_cfg
        self.transport, self.replicator, self.gate = transport, replicator, gate
        self.dataservers, self.token = dataservers, token
        self._corrupt = corrupt
        self._fresh_said: set[str] = set()  # jobs whose partial first commit was logged
        self._pinned: dict[str, int] = {}  # slot path → durable writes in progress
        self._tasks: set[asyncio.Task[None]] = set()
        self._durable_pool = ThreadPoolExecutor(1, thread_name_prefix="ffplane-durable")
        self.durable_written = 0
        self.pulled_bytes = 0
        self.restores_behind = 0  # job-wide restores that went more than one step back
        self._pulls: dict[tuple[str, str, int], asyncio.Future[LocalShard]] = {}
        self.latencies = latencies or Latencies()

    async def begin(self, job: str, role: str, step: int, settled: bool) -> str:
        """A slot for ``step``; a role whose save cannot overwrite any slot it has (not settled,
        or a durable copy holds the one it would take) is given one more, once."""
        settled = self.settles(settled)
        pinned = set(self._pinned)  # a slot still being copied to the durable tier must not be overwritten
        try:
            return self.slots.begin(job, role, step, settled, exclude=pinned)
        except SlotBusyError:
            rs = self.slots.roles[(job, role)]
            if any(p in rs.writing for p in rs.paths if p not in pinned):
                raise  # a save of this role is in progress: the writer waits for it
            why = "its saves are not settled (see trainer_client.settle_all)" if not settled else "a durable copy holds a slot"
            await self.slots.grow(job, role, why)
            return self.slots.begin(job, role, step, settled, exclude=pinned)

    def reserve(self, job: str, role: str) -> tuple[str, bool] | None:
        """The slot for the role's next save, handed out with a commit's reply (see ``SlotStore.reserve``)."""
        return self.slots.reserve(job, role, exclude=set(self._pinned))

    def settles(self, settled: bool) -> bool:
        """Whether a save the writer says is settled proves what it should: only if commit
        answers wait for their replica (``--replica-max-lag`` above 0), or nothing replicates."""
        return settled and (self.replicator is None or self.replicator.max_lag > 0)

    async def commit(
        self, job: str, role: str, step: int, slot: str, nbytes: int, header: dict[str, Any], save_block_s: float, **how: Any
    ) -> Version:
        """Commit ``step`` (``how``: ``SlotStore.commit``'s reservation and static-header options)."""
        how["settled"] = self.settles(how.get("settled", False))
        version = await self.slots.commit(job, role, step, slot, nbytes, header, save_block_s, **how)
        self.latencies.save_block.observe(version.save_block_s)
        self.latencies.commit.observe(version.commit_s)
        self.replicas.drop_pulled(job, below=step)
        self._corrupt.job_saved(job)
        if self.replicator is not None:
            self.replicator.committed(job, role, step)
        if self.durable.due(step):
            self._pinned[slot] = self._pinned.get(slot, 0) + 1
            task = asyncio.create_task(self._write_durable(job, role, version), name=f"durable {job}/{role}/{step}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if self.replicator is not None:
            await self.replicator.until_replicated(job, role, step)
        return version

    async def _write_durable(self, job: str, role: str, v: Version) -> None:
        assert self.durable.directory is not None
        try:
            data = memoryview(self.slots.mapped(v.path))[: v.nbytes]
            loop, gate = asyncio.get_running_loop(), self.gate

            def admit(n: int) -> None:  # from the writer thread: wait at the gate, lowest priority
                if gate is not None:
                    asyncio.run_coroutine_threadsafe(gate.acquire(Priority.DURABLE, n), loop).result()

            chunk = max(gate.config.chunk_bytes if gate else 0, 4 << 20)
            # its own thread: a copy waiting at the gate must not hold a thread that commits need
            write = functools.partial(write_shard, self.durable.directory, job, role, v.step, data, v.checksum, v.header, admit, chunk)
            await loop.run_in_executor(self._durable_pool, write)
            self.durable_written += 1
        except Exception:
            log.exception("durable write failed", extra={"job": job, "role": role, "step": v.step})
        finally:
            self._pinned[v.path] -= 1
            if not self._pinned[v.path]:
                del self._pinned[v.path]

    def local(self, job: str, role: str, step: int) -> LocalShard | None:
        return find_local(self.slots, self.replicas, job, role, step)

    async def held(self, job: str, role: str, step: int) -> LocalShard | None:
        """A shard held here, or rebuilt here from parity (``statestore.parity``)."""
        return self.local(job, role, step) or await self.rebuilt(job, role, step)

    async def rebuilt(self, job: str, role: str, step: int) -> LocalShard | None:
        """``role``'s shard of ``step`` rebuilt from the parity held here and the other members'
        shards of the step, pulled from their nodes; kept as a pulled shard once its checksum and
        header digest match what its primary recorded. None when no parity here covers it."""
        parity = self.replicas.parity
        if parity is None or parity.covers(job, role, step) is None:
            return None
        key = (job, role, step)
        pending = self._pulls.get(key)
        if pending is None:
            pending = asyncio.ensure_future(self._rebuild(job, role, step))
            self._pulls[key] = pending
            pending.add_done_callback(lambda _: self._pulls.pop(key, None))
        return await asyncio.shield(pending)

    async def _rebuild(self, job: str, role: str, step: int) -> LocalShard:
        parity = self.replicas.parity
        assert parity is not None
        acc = parity.covers(job, role, step)
        if acc is None:
            raise NotFoundError(f"the parity of {role} step {step} went while it was being rebuilt")
        m = acc.members[role]
        out = parity.start(acc)
        members = self.replicator.heartbeat.view.get("members", {}) if self.replicator is not None else {}
        for other in parity.others(acc, role):
            base = members.get(other.source)
            if base is None:
                raise NotFoundError(f"cannot rebuild {role} step {step}: {other.role}'s node {other.source} is not alive")
            # kept as a pulled shard (a restore here may want it too; a newer commit drops it)
            try:
                shard = self.local(job, other.role, step) or await self._pull(job, other.role, step, [(other.source, base)])
            except _NoIntactCopy as exc:
                raise NotFoundError(f"cannot rebuild {role} step {step}: {exc}") from None
            if shard.checksum != other.checksum:
                raise CorruptError(f"{other.role} step {step} on {other.source} is not the shard the parity holds")
            parity.xor_into(out, shard.view())
        offset = self.replicas.begin(
            job, role, step, m.nbytes, m.checksum, m.header, self.node_id, kind="pulled", header_digest=m.header_digest
        )

        async def rebuilt_bytes() -> AsyncIterator[memoryview]:
            yield memoryview(out)[offset : m.nbytes]

        if offset < m.nbytes:
            await self.replicas.receive(job, role, step, offset, rebuilt_bytes())
        await self.replicas.finish(job, role, step)  # the rebuilt bytes against the primary's checksum and header digest
        self.pulled_bytes += m.nbytes
        log.info("shard rebuilt from parity", extra={"job": job, "role": role, "step": step, "members": len(acc.members)})
        rebuilt = self.local(job, role, step)
        assert rebuilt is not None
        return rebuilt

    async def verify(self, job: str, step: int, roles: list[str] | None = None) -> list[str]:
        """The roles (default: every role saving here) whose shard of ``step`` held here fails its
        checksum or is gone. A corrupt copy is dropped at once, so the next ``restorable`` of the
        same step takes another copy (a replica on another node, the durable tier) instead of an
        older step."""
        if roles is None:
            roles = sorted(self.slots.versions_at(job, step))
            if not roles:
                return ["*"]
        shards = {r: self.local(job, r, step) for r in roles}
        held = {r: s for r, s in shards.items() if s is not None}
        results = await asyncio.gather(*(asyncio.to_thread(s.intact) for s in held.values()))
        bad = sorted(r for r, s in shards.items() if s is None)
        for (r, shard), ok in zip(held.items(), results):
            if not ok:
                self.quarantine(shard)
                bad.append(r)
        return sorted(bad)

    def quarantine(self, shard: LocalShard) -> None:
        """Drop a copy held here that failed its checksum, and never offer it again."""
        self._corrupt.quarantine(shard)

    @property
    def quarantined(self) -> int:
        return self._corrupt.dropped

    # --- restore -------------------------------------------------------------------------
    async def restorable(
        self, job: str, verify: bool = True, below: int | None = None, roles: list[str] | None = None, step: int | None = None
    ) -> dict[str, Any]:
        """The step to restore and where its shards are, on this node.

        With ``roles`` (the asking worker's role and its dp peers) the step is job-wide: the
        coordinator's view of every daemon's inventory picks the newest step every role of the job
        has somewhere alive, and the shards of ``roles`` that are not here are pulled first. Without
        a coordinator, or without ``roles``, only what this daemon holds counts.
        """
        if roles is not None and self.dataservers is not None:
            started = time.perf_counter()
            status = await self._job_status(job)
            if status is None:  # guessing from this node alone could split the job across steps
                raise UnavailableError("the coordinator (data server) did not answer, so no job-wide restore step can be chosen; ask again")
            found = await self._restorable_jobwide(job, status, roles, below, step)
            self.latencies.restore.observe(time.perf_counter() - started)
            return found
        if step is not None:
            below = step + 1
        found_step, versions = await self.slots.restorable(job, verify, below)
        if found_step is not None and (step is None or found_step == step):
            return {
                "step": found_step,
                "source": "memory",
                "shards": {r: self._shard_reply(self.local(job, r, found_step)) for r in versions},
                "roles": sorted(versions),
            }
        known = {r for (j, r) in self.slots.roles if j == job}
        return await self._durable(job, "no intact copy in this daemon's memory" if known else "", step)

    async def _restorable_jobwide(
        self, job: str, status: dict[str, Any], roles: list[str], below: int | None, step: int | None
    ) -> dict[str, Any]:
        """Newest step with an intact copy of every role of its layout: per role, every copy of a
        step (here, on a live node, in the durable tier) is tried before the step is given up for
        an older one. The reply has the shards of those of ``roles`` that the step's layout names,
        and that layout's roles."""
        copies = await self._copies_jobwide(job, status)
        candidates = whole_steps(copies.anywhere, copies.layouts, below if step is None else step + 1)
        if step is not None:
            candidates = [step] if step in candidates else []
        corrupt: list[str] = []
        for chosen in candidates:
            try:
                wanted = [r for r in roles if r in copies.layouts.of(chosen)]
                got = await asyncio.gather(
                    *(self._copy_of(job, r, chosen, copies.holders(r, chosen), copies.alive, copies.on_disk_has(r, chosen)) for r in wanted)
                )
            except _NoIntactCopy as exc:
                corrupt.append(str(exc))
                log.warning(
                    "no intact copy of a role at this step: trying an older one", extra={"job": job, "step": chosen, "error": str(exc)}
                )
                continue
            return self._jobwide_reply(job, copies, chosen, dict(zip(wanted, got)), said_behind=step is None)
        if corrupt:
            return {
                "step": None,
                "source": None,
                "shards": {},
                "corrupt": True,
                "message": "every copy failed its checksum: " + "; ".join(corrupt),
            }
        return await self._no_whole_step(job, status, copies, step)

    async def _copies_jobwide(self, job: str, status: dict[str, Any]) -> _JobCopies:
        """Every copy of ``job`` a restore may use: on live nodes as the coordinator's ``status``
        has them, here, in the durable tier; less those found corrupt."""
        alive = {n: m["address"] for n, m in status.get("members", {}).items() if m.get("alive")}
        where: dict[str, dict[int, list[str]]] = {
            r: {int(s): [n for n in nodes if n in alive] for s, nodes in steps.items()}
            for r, steps in status.get("shard_locations", {}).items()
        }
        layouts = Layouts()
        for s, names in status.get("layouts", {}).items():
            layouts.add(int(s), names)
        for r, steps in self._local_copies(job).items():  # what is here counts even if the coordinator has not heard of it yet
            for s, names in steps.items():
                where.setdefault(r, {}).setdefault(s, []).insert(0, self.node_id)
                layouts.add(s, names)
        for r, steps in where.items():  # copies found corrupt are not asked again
            for s, nodes in steps.items():
                nodes[:] = [n for n in nodes if (job, r, s, n) not in self._corrupt]
        on_disk: dict[str, set[int]] = {}
        if self.durable.directory:
            on_disk, disk_layouts = await asyncio.to_thread(durable.layouts, self.durable.directory, job)
            for s, names in disk_layouts.roles.items():
                layouts.add(s, names)
        known = set(where) | set(on_disk)
        have = {r: {s for s, nodes in where.get(r, {}).items() if nodes} for r in known}
        anywhere = {r: have[r] | {s for s in on_disk.get(r, set()) if (job, r, s, _DURABLE) not in self._corrupt} for r in known}
        return _JobCopies(alive, where, layouts, on_disk, have, anywhere)

    def _jobwide_reply(
        self, job: str, copies: _JobCopies, chosen: int, shards: dict[str, dict[str, Any]], said_behind: bool
    ) -> dict[str, Any]:
        """The reply restoring ``chosen`` from ``shards`` (a role's each); with ``said_behind``,
        a step more than one behind the newest copy is said loudly (``_behind``)."""
        newest_copy = max((s for steps in copies.anywhere.values() for s in steps), default=chosen)
        behind = self._behind(job, chosen, newest_copy, copies.layouts, copies.anywhere, copies.where) if said_behind else ""
        kinds = {g["kind"] == "durable" for g in shards.values()}
        source = "durable" if kinds == {True} else "memory" if kinds == {False} else "memory+durable"
        reply: dict[str, Any] = {"step": chosen, "source": source, "shards": shards, "roles": sorted(copies.layouts.of(chosen))}
        if source != "memory":
            disk = sorted(r for r, g in shards.items() if g["kind"] == "durable")
            reply["message"] = (
                f"restoring step {chosen}: {', '.join(disk)} from the durable tier {self.durable.directory} (no intact copy in memory on a live node)"
            )
        if behind:
            reply["message"] = f"{reply['message']}; {behind}" if reply.get("message") else behind
        return reply

    async def _no_whole_step(self, job: str, status: dict[str, Any], copies: _JobCopies, step: int | None) -> dict[str, Any]:
        """No step (or not ``step``) has a copy of every role: the durable tier's, with the reason
        memory has none (a step no longer kept, a job that lost its copies, a fresh start)."""
        anywhere, layouts, have = copies.anywhere, copies.layouts, copies.have
        if step is not None and (kept := whole_steps(anywhere, layouts)):
            # a step asked for by number (export, a DCP load) that is no longer kept
            return await self._durable(
                job,
                f"it is no longer kept (each role keeps its newest versions); the steps of job {job!r} that can be "
                f"restored or exported now: {', '.join(map(str, sorted(kept)))}",
                step,
            )
        if not any(have.values()):  # nothing in memory anywhere: a fresh job, one restarted from disk, or one that lost everything
            had = status.get("committed_step")
            reason = (
                ""
                if had is None
                else (
                    f"job {job!r} committed step {had}, but no role has a copy in memory on a live node (dead nodes: "
                    f"{status.get('dead', [])}); starting it from nothing would silently throw the run away"
                )
            )
            return await self._durable(job, reason, step)
        newest = layouts.of(max(layouts.roles)) if layouts.roles else set()
        lost = sorted(r for r in newest if not have.get(r))
        dead = status.get("dead", [])
        held = {s for steps in have.values() for s in steps}
        if status.get("whole_step_anywhere", -1) is None and len(held) == 1:
            # the job's first commit, made by some roles only (a rank failed before it): there was
            # never anything to restore, so the job starts fresh, on every node alike
            if job not in self._fresh_said:
                self._fresh_said.add(job)
                log.warning(
                    "job %r: step %d was committed by %s only (never by %s) and no step of the job was ever committed by "
                    "every role: nothing to restore, the job starts fresh",
                    job,
                    min(held),
                    ", ".join(sorted(r for r in have if have[r])),
                    ", ".join(lost),
                    extra={"job": job, "step": min(held)},
                )
            return await self._durable(job, "", step)
        reason = (
            f"no step of job {job!r} has every role in memory on a live node (roles without any copy: {lost or 'none'}; "
            f"dead nodes: {dead}); a node and its ring successor were probably lost together"
        )
        return await self._durable(job, reason, step)

    def _behind(
        self,
        job: str,
        chosen: int,
        newest: int,
        layouts: Layouts,
        anywhere: dict[str, set[int]],
        where: dict[str, dict[int, list[str]]],
    ) -> str:
        """Say loudly (an error line, the reply's message, a metric) when a restore goes back more
        than the one step a failure may cost, naming the roles the newer steps miss; "" otherwise."""
        if chosen >= newest - 1:
            return ""
        missing = {s: sorted(r for r in layouts.of(s) if s not in anywhere.get(r, set())) for s in sorted(layouts.roles) if s > chosen}
        lacking = sorted({r for roles in missing.values() for r in roles})
        self.restores_behind += 1
        text = (
            f"job {job!r} restores step {chosen}, {newest - chosen} steps behind its newest copy (step {newest}): "
            f"no intact copy on a live node of {', '.join(lacking) or 'some role'} for steps {chosen + 1}..{newest}"
        )
        log.error(
            "%s",
            text,
            extra={
                "job": job,
                "step": chosen,
                "newest": newest,
                "missing": {s: r for s, r in list(missing.items())[-4:]},
                "where": {r: {s: where.get(r, {}).get(s, []) for s in sorted(anywhere.get(r, set()))[-4:]} for r in sorted(anywhere)},
            },
        )
        return text

    async def _copy_of(self, job: str, role: str, step: int, holders: list[str], alive: dict[str, str], on_disk: bool) -> dict[str, Any]:
        """A copy of ``role``'s shard of ``step`` to restore from: this node's, else one pulled
        (and verified) from a live holder, else the durable tier's (verified)."""
        shard = self.local(job, role, step)
        if shard is not None:
            return self._shard_reply(shard)  # verified by the restoring worker's ``verify`` call
        remote = [(n, alive[n]) for n in holders if n != self.node_id]
        failures = []
        unavailable = None
        if remote:
            try:
                return self._shard_reply(await self._pull(job, role, step, remote))
            except _NoIntactCopy as exc:
                failures.append(str(exc))
            except UnavailableError as exc:
                unavailable = exc
        try:  # a parity held here: k shards moved, where a whole copy elsewhere moved one
            shard = await self.rebuilt(job, role, step)
            if shard is not None:
                return self._shard_reply(shard)
        except FFPlaneError as exc:
            failures.append(str(exc))
        if unavailable is not None:
            raise unavailable
        if on_disk and self.durable.directory is not None:
            found = await asyncio.to_thread(durable.shard, self.durable.directory, job, role, step)
            if found is not None:
                return {**found, "kind": "durable"}
            self._corrupt.add(job, role, step, _DURABLE)
            failures.append(f"the durable copy in {self.durable.directory} failed its checksum")
        raise _NoIntactCopy(f"{role} step {step}: {'; '.join(failures) or 'no copy left'}")

    def _local_copies(self, job: str) -> dict[str, dict[int, list[str]]]:
        """Role → step → the layout's roles, for every copy of ``job`` held here (own saves and
        complete replicas)."""
        out: dict[str, dict[int, list[str]]] = {}
        for (j, role), rs in self.slots.roles.items():
            if j == job:
                for v in rs.versions.values():
                    out.setdefault(role, {})[v.step] = layout_roles(v.header, role)
        for (j, role), versions in self.replicas.complete.items():
            if j == job:
                for r in versions.values():
                    out.setdefault(role, {})[r.step] = layout_roles(r.header, role)
        parity = self.replicas.parity
        for role, members in parity.inventory(job).items() if parity is not None else ():
            for m in members:
                out.setdefault(role, {})[m.step] = layout_roles(m.header, role)
        return out

    async def _pull(self, job: str, role: str, step: int, holders: list[tuple[str, str]]) -> LocalShard:
        """Fetch a shard from the first holder that answers; workers of this node asking for the
        same shard at once share one transfer."""
        key = (job, role, step)
        pending = self._pulls.get(key)
        if pending is None:
            pending = asyncio.ensure_future(self._pull_once(job, role, step, holders))
            self._pulls[key] = pending
            pending.add_done_callback(lambda _: self._pulls.pop(key, None))
        return await asyncio.shield(pending)

    async def _pull_once(self, job: str, role: str, step: int, holders: list[tuple[str, str]]) -> LocalShard:
        errors, unreachable = [], False
        for node, base in holders:
            try:
                r = await self.transport.pull(base, self.replicas, job, role, step, node)
                self.pulled_bytes += r.nbytes
                log.info("shard pulled for a restore", extra={"job": job, "role": role, "step": step, "from": base, "bytes": r.nbytes})
                shard = self.local(job, role, step)
                assert shard is not None
                return shard
            except FFPlaneError as exc:
                errors.append(f"{node} ({base}): {exc}")
                if exc.status in (CorruptError.status, NotFoundError.status):  # its copy is corrupt, or gone: never ask it again
                    self._corrupt.add(job, role, step, node)
                else:
                    unreachable = True
        if not unreachable:
            raise _NoIntactCopy(f"no holder has an intact copy ({'; '.join(errors) or 'no live holder'})")
        raise UnavailableError(
            f"cannot fetch {role} step {step} of job {job!r} from any holder ({'; '.join(errors)}); retry once the coordinator has noticed the failure"
        )

    async def _durable(self, job: str, reason: str, step: int | None = None) -> dict[str, Any]:
        """The newest durable step (exactly ``step`` when the ranks agreed on one)."""
        if self.durable.directory is not None:
            below = None if step is None else step + 1
            dstep, dshards = await asyncio.to_thread(durable.restorable, self.durable.directory, job, below)
            if dstep is not None and (step is None or dstep == step):
                message = f"{reason or 'nothing in memory'}: restoring step {dstep} from the durable tier {self.durable.directory}"
                log.warning(message, extra={"job": job, "step": dstep})
                return {"step": dstep, "source": "durable", "shards": dshards, "roles": sorted(dshards), "message": message}
        return {"step": None, "source": None, "shards": {}, "message": reason or None}

    def _shard_reply(self, shard: LocalShard | None) -> dict[str, Any]:
        assert shard is not None
        return {
            "path": str(self.root / shard.rel),
            "offset": 0,
            "nbytes": shard.nbytes,
            "checksum": shard.checksum,
            "header": shard.header,
            "header_digest": shard.header_digest,
            "kind": shard.kind,
        }

    async def _job_status(self, job: str) -> dict[str, Any] | None:
        assert self.dataservers is not None
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as session:
                # a server that just took over coordination answers 503 for a moment: wait it out
                code, body = await self.dataservers.coordinator(
                    session, "GET", f"/v1/jobs/{job}/status", headers=bearer(self.token), patience_s=_SETTLE_WAIT_S
                )
            if code != 200:
                log.warning("coordinator answered %s; restoring from this node only", code)
                return None
            status: dict[str, Any] = json.loads(body)
            return status
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            log.warning("coordinator unreachable (%s); restoring from this node only", exc)
            return None

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._durable_pool.shutdown(wait=False)


_DURABLE = "(durable)"  # the durable tier's copy, in ``CorruptCopies``


@dataclass
class _JobCopies:
    """Where a job's copies are, as a job-wide restore sees them (``StateService._copies_jobwide``)."""

    alive: dict[str, str]  # live node → its address
    where: dict[str, dict[int, list[str]]]  # role → step → the live nodes holding a copy not found corrupt (this one first)
    layouts: Layouts  # step → the roles of its layout
    on_disk: dict[str, set[int]]  # role → its steps in the durable tier
    have: dict[str, set[int]]  # role → its steps in memory on a live node
    anywhere: dict[str, set[int]]  # role → its steps in memory or in the durable tier, less copies found corrupt

    def holders(self, role: str, step: int) -> list[str]:
        return self.where.get(role, {}).get(step, [])

    def on_disk_has(self, role: str, step: int) -> bool:
        return step in self.on_disk.get(role, set())


class _NoIntactCopy(Exception):
    """Every copy of a role's shard at one step failed its checksum (or is gone)."""
