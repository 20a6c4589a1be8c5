"""State slots: every local role's newest committed checkpoint shards, in reused shared memory.

Each role gets ``versions`` slot files (2 by default), allocated once at its first save with the
whole size reserved (``posix_fallocate`` — a save that does not fit fails then, with a message,
instead of a SIGBUS later) and reused for every save: a save overwrites the oldest version once
no role can need it (``statestore.retention``), and a role whose saves are not settled gets one
slot more. The worker maps its slots once and copies its bytes in; the daemon then checksums the
slot and records the version in the LMDB index — only then is it *committed*. A worker killed
mid-copy leaves an uncommitted slot and the previous versions intact.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import mmap
import os
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb

from ffplane_contract.checksum import ALGORITHM, checksum
from ffplane_contract.errors import (
    CapacityError,
    CorruptError,
    FFPlaneError,
    NoSlotsError,
    SlotBusyError,
    StaticHeaderUnknownError,
    UnknownSlotError,
)
from ffplane_contract.restorable import Layouts, whole_steps
from ffplane_contract.shard import PER_STEP, header_digest, header_intact, layout_roles, static_digest
from statestore import retention, shm
from statestore.budget import SLOTS_HOLDER, Budget
from statestore.index import Index, encode, remove_sidecar, write_sidecar
from statestore.latencies import Parts

log = logging.getLogger(__name__)
RESERVED = -1  # ``writing`` value of a slot handed out for a role's next save, step not yet known
# Below this a commit checksums on the event loop (≤ ~0.5 ms held): handing it to a thread costs
# ~0.1 ms of CPU here (two wake-ups), as much as checksumming 2 MiB, on cores training keeps busy.
INLINE_CHECKSUM_BYTES = 8 << 20


@dataclass
class Version:
    step: int
    path: str  # slot file, relative to the root
    nbytes: int
    checksum: str
    header: dict[str, Any]
    committed_at: float
    save_block_s: float = 0.0  # the worker's blocking copy, as it reported it
    commit_s: float = 0.0  # checksum + index, in the daemon
    static: str = ""  # digest of the header's static part, stored once per role (``RoleState.statics``)
    header_digest: str = ""  # of the whole header (``protocol.shard.header_digest``): checked wherever the checksum is

    def index_entry(self) -> dict[str, Any]:
        """What the index keeps: with a static digest, only the header's per-step part."""
        entry = dict(vars(self))  # vars, not asdict: asdict deep-copies the header, 2.4 ms a commit
        if self.static:
            entry["header"] = {k: v for k, v in self.header.items() if k in PER_STEP}
        return entry


@dataclass
class RoleState:
    job: str
    role: str
    gen: int = 0
    size: int = 0
    paths: list[str] = field(default_factory=list)
    versions: dict[int, Version] = field(default_factory=dict)
    writing: dict[str, int] = field(default_factory=dict)  # slot path → step being written (or RESERVED)
    statics: dict[str, dict[str, Any]] = field(default_factory=dict)  # digest → static header part
    settled: bool | None = None  # whether its last save was settled (None: none since the daemon started)
    settled_only: set[str] = field(default_factory=set)  # reserved slots only a settled save may write
    grown: str = ""  # why it has a slot more than ``versions`` (said once)

    def newest(self, n: int) -> list[Version]:
        return [self.versions[s] for s in sorted(self.versions, reverse=True)[:n]]

    def holding(self, slot: str) -> list[int]:
        """The steps whose version ``slot`` holds (at most one)."""
        return [s for s, v in self.versions.items() if v.path == slot]


def version_key(job: str, role: str, step: int) -> str:
    return f"state/{job}/{role}/{step:012d}"


class SlotStore:
    def __init__(self, root: Path, index: Index, budget: Budget, versions: int = retention.DEFAULT_VERSIONS) -> None:
        """``budget``: the daemon's one ledger, shared with the data cache and the replicas; the
        slots count in it as ``slots``. ``versions``: committed versions kept per role."""
        self.versions = versions
        self.root = root
        self._root = str(root)  # the per-save paths are strings (see index.write_sidecar)
        self.index = index
        self.budget = budget
        self.roles: dict[tuple[str, str], RoleState] = {}
        self._maps: dict[str, mmap.mmap] = {}
        self.commit_parts = Parts()  # where a commit's time goes (/v1/state)
        budget.register(SLOTS_HOLDER, self.slot_bytes)

    # --- lifecycle -----------------------------------------------------------------------
    def reattach(self) -> int:
        """Adopt every role's slots and committed versions whose files are intact."""
        n = 0
        for key, entry in self.index.items("slots/"):
            _, job, role = key.split("/")
            paths = entry["paths"]
            if all((self.root / p).is_file() and (self.root / p).stat().st_size == entry["size"] for p in paths):
                self.roles[(job, role)] = RoleState(job, role, entry["gen"], entry["size"], paths)
            else:
                self.index.delete(key)
        for key, entry in self.index.items("statics/"):
            _, job, role, digest = key.split("/")
            if (job, role) in self.roles and _static_intact(key, entry, digest):
                self.roles[(job, role)].statics[digest] = entry
        for key, entry in self.index.items("state/"):
            _, job, role, _step = key.split("/")
            rs = self.roles.get((job, role))
            v = Version(**entry)
            static = rs.statics.get(v.static) if rs is not None and v.static else {}
            if rs is None or static is None or not (self.root / v.path).is_file():
                self.index.delete(key)
                continue
            v.header = {**static, **v.header}
            if not header_intact(v.header, v.header_digest):  # changed at rest: a corrupt copy, as damaged bytes are
                log.error(
                    "a committed version's header does not match its digest: dropped (its replica is used instead)",
                    extra={"job": job, "role": role, "step": v.step},
                )
                self.index.delete(key)
                continue
            rs.versions[v.step] = v
            n += 1
        for rs in self.roles.values():
            self._forget_statics(rs)
        return n

    def slot_bytes(self) -> int:
        return sum(len(r.paths) * r.size for r in self.roles.values())

    def mapped(self, rel: str) -> mmap.mmap:
        mm = self._maps.get(rel)
        if mm is None:
            fd = os.open(self.root / rel, os.O_RDONLY)
            try:
                mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            self._maps[rel] = mm
        return mm

    def close(self) -> None:
        while self._maps:
            self._maps.popitem()[1].close()

    # --- protocol ------------------------------------------------------------------------
    async def alloc(self, job: str, role: str, nbytes: int) -> list[str]:
        """Slots of at least ``nbytes`` for ``role``; reuses the current ones when they fit."""
        rs = self.roles.get((job, role)) or RoleState(job, role)  # registered only once allocated
        if rs.size >= nbytes and rs.paths:
            return rs.paths
        size = max(nbytes, 1)
        count = max(self.versions, len(rs.paths))  # a role given a slot more keeps it
        grow = count * size - self._live_bytes(rs)
        free = self.budget.free()
        if grow > free:
            raise CapacityError(
                f"role {role} of job {job} needs {count} slots x {size / 2**20:.1f} MiB but only "
                f"{max(free, 0) / 2**20:.1f} MiB of the daemon's budget is left; raise the daemon's "
                "--budget-mb (and the tmpfs size) or save less state per role",
            )
        rs.gen += 1
        directory = shm.private_dir(self.root / job / "state" / role)
        paths = [str((directory / f"slot-{rs.gen}-{k}.bin").relative_to(self.root)) for k in range(count)]
        for path in paths:
            await asyncio.to_thread(_prefault, self.root / path, size)
        old = set(rs.paths)
        rs.paths, rs.size = paths, size
        self.roles[(job, role)] = rs
        self._record_paths(rs)
        self._release_unreferenced(rs, old)
        log.info("slots allocated", extra={"job": job, "role": role, "slot_bytes": size, "slots": count})
        return paths

    async def grow(self, job: str, role: str, why: str) -> None:
        """One slot more for ``role``, whose next save cannot overwrite any it has (``why``);
        said once per role. At most ``retention.files(versions, settled=False)`` slots."""
        rs = self.roles[(job, role)]
        if len(rs.paths) >= max(self.versions, retention.files(self.versions, settled=False)):
            return
        if rs.size > self.budget.free():
            raise CapacityError(
                f"role {role} of job {job} needs one slot more ({why}) but only {max(self.budget.free(), 0) / 2**20:.1f} MiB "
                "of the daemon's budget is left; raise the daemon's --budget-mb",
            )
        path = shm.private_dir(self.root / job / "state" / role) / f"slot-{rs.gen}-{len(rs.paths)}.bin"
        await asyncio.to_thread(_prefault, path, rs.size)
        rs.paths = [*rs.paths, str(path.relative_to(self.root))]
        self._record_paths(rs)
        if not rs.grown:
            rs.grown = why
            log.warning(
                "a role keeps one slot more than --versions",
                extra={"job": job, "role": role, "why": why, "slots": len(rs.paths), "slot_bytes": rs.size},
            )

    def _record_paths(self, rs: RoleState) -> None:
        self.index.put(f"slots/{rs.job}/{rs.role}", {"gen": rs.gen, "size": rs.size, "paths": rs.paths})

    def _live_bytes(self, rs: RoleState) -> int:
        return len(rs.paths) * rs.size

    def _release_unreferenced(self, rs: RoleState, candidates: set[str]) -> None:
        referenced = {v.path for v in rs.versions.values()} | set(rs.paths)
        for rel in candidates - referenced:
            mm = self._maps.pop(rel, None)
            if mm is not None:
                mm.close()
            (self.root / rel).unlink(missing_ok=True)
            remove_sidecar(self.root / rel)

    def begin(self, job: str, role: str, step: int, settled: bool = False, exclude: AbstractSet[str] = frozenset()) -> str:
        """Pick the slot for ``step``: one holding none of the versions a save (``settled`` or
        not: ``retention.kept_while_writing``) keeps, nor in use. ``SlotBusyError`` if none is."""
        rs = self._role(job, role)
        free = self._free(rs, settled, exclude)
        if not free:
            raise SlotBusyError(
                f"no free slot for {role} step {step}: a save is still being committed or copied to the durable tier; wait for it"
            )
        slot = free[0]
        self._overwrite(rs, slot)
        rs.writing[slot] = step
        return slot

    def reserve(self, job: str, role: str, exclude: AbstractSet[str] = frozenset()) -> tuple[str, bool] | None:
        """A slot for the role's next save, whatever its step, handed out with a commit's reply,
        and whether only a settled save may write it (it holds a version an unsettled one keeps);
        None if there is none. The version the slot holds stays listed until a save is
        committed there: the save is written later, when none can need it any more."""
        rs = self._role(job, role)
        for settled in (False, True):
            free = self._free(rs, settled, exclude)
            if free:
                rs.writing[free[0]] = RESERVED
                if settled:
                    rs.settled_only.add(free[0])
                return free[0], settled
        return None

    def _role(self, job: str, role: str) -> RoleState:
        rs = self.roles.get((job, role))
        if rs is None or not rs.paths:
            raise NoSlotsError(f"role {role} of job {job} has no slots; send 'alloc' first")
        return rs

    def _free(self, rs: RoleState, settled: bool, exclude: AbstractSet[str]) -> list[str]:
        """Slots a save may write, empty ones first, then the oldest version's."""
        keep = {v.path for v in rs.newest(retention.kept_while_writing(self.versions, settled))}
        order = {v.path: s for s, v in rs.versions.items()}
        free = [p for p in rs.paths if p not in keep and p not in rs.writing and p not in exclude]
        return sorted(free, key=lambda p: order.get(p, -1))

    def _overwrite(self, rs: RoleState, slot: str) -> None:
        """Forget the version ``slot`` holds: a save is about to be written over it."""
        stale = rs.holding(slot)
        for s in stale:
            del rs.versions[s]
        if stale:  # its sidecar stays until the commit replaces it: a rebuild adopts only the newest
            self.index.delete(*(version_key(rs.job, rs.role, s) for s in stale))

    def abandon(self, job: str, role: str, slot: str) -> None:
        """The writer went away or gave up before committing: the slot is free again (it holds
        no version)."""
        rs = self.roles.get((job, role))
        if rs is not None:
            rs.writing.pop(slot, None)
            rs.settled_only.discard(slot)

    async def commit(
        self,
        job: str,
        role: str,
        step: int,
        slot: str,
        nbytes: int,
        header: dict[str, Any],
        save_block_s: float,
        reserved: bool = False,
        settled: bool = False,
        static: str = "",
        static_header: dict[str, Any] | None = None,
    ) -> Version:
        """Checksum the slot and record ``step`` in it.

        ``reserved``: the writer took the slot from a commit reply; a restarted daemon, which
        never handed it out, adopts it if it is one of the role's slots and holds nothing a save
        (``settled`` or not) keeps (the writer copied into it before the restart). ``static``: the digest of the header's
        static part (every key but the tree: tensors, storages, layout), which the writer sends
        (``static_header``) only when it changes; an unknown digest is refused with 428.
        """
        rs = self.roles.get((job, role))
        if rs is None:  # as for 'begin': a daemon that never had, or lost, this role's slots
            raise NoSlotsError(f"role {role} of job {job} has no slots here; send 'alloc' first")
        if reserved and self._adoptable(rs, slot, settled):
            rs.writing[slot] = RESERVED
        if rs.writing.get(slot) not in (step, RESERVED) or (rs.writing[slot] == RESERVED and not reserved):
            raise UnknownSlotError(f"commit of {role} step {step} to {slot} was not begun here")
        if slot in rs.settled_only and not settled:
            raise UnknownSlotError(f"commit of {role} step {step} to {slot}: that slot was reserved for a settled save")
        rs.settled_only.discard(slot)
        self._overwrite(rs, slot)  # a reserved slot's version is gone now
        rs.settled = settled
        if not 0 <= nbytes <= rs.size:
            raise FFPlaneError(f"commit of {nbytes} bytes exceeds the slot size {rs.size}")
        if static and static_header is None and static not in rs.statics:
            raise StaticHeaderUnknownError(
                f"static header {static} of {role} is not known here (a restarted daemon?); send it with the commit"
            )
        started = time.perf_counter()
        mm = self.mapped(slot)
        data = memoryview(mm)[:nbytes]
        digest = checksum(data) if nbytes <= INLINE_CHECKSUM_BYTES else await asyncio.to_thread(checksum, data)
        hashed = time.perf_counter()
        if static_header is not None and static not in rs.statics and static_digest(static_header) != static:
            raise CorruptError(f"the static header sent with {role} step {step} is not the one its digest {static} names")
        if static and static_header is not None and static not in rs.statics:
            self._record(
                rs, slot, f"the static header of {role}", len(encode(static_header)), lambda: self._put_static(rs, static, static_header)
            )
        if static:
            header = {**rs.statics[static], **header}
        # the daemon's word, not the writer's: it travels with the replica (``ReplicaStore.begin``)
        header = {k: v for k, v in header.items() if k != "settled"} | ({"settled": True} if settled else {})
        version = Version(
            step, slot, nbytes, digest, header, time.time(), save_block_s, static=static, header_digest=header_digest(header, static)
        )
        version.commit_s = time.perf_counter() - started
        # Versions above this step belong to a future the run rewound from (a restore to an
        # older step, a restarted job): they must not outrank what is saved now.
        kept = {*rs.versions, step}
        # The rest stay until a save needs their slot (``begin``): as many as the role has slots,
        # or needs (older ones, in slots given up for larger ones, at a change of size).
        keep = max(len(rs.paths), retention.files(self.versions, settled))
        stale = [s for s in kept if s > step] + sorted(s for s in kept if s <= step)[:-keep]
        recorded = time.perf_counter()
        entry = encode(version.index_entry())  # once, for the index and the sidecar
        # The sidecar (what a rebuild of a lost index adopts, after verifying it) comes before the
        # commit point, so a full tmpfs refuses the commit with nothing recorded: written after it,
        # a failure left the index a step ahead of the running daemon, and the slot taken.
        self._record(rs, slot, f"the record of {role} step {step}", len(entry), lambda: write_sidecar(f"{self._root}/{slot}", entry))
        written = time.perf_counter()

        def commit_point() -> None:  # the index forgets what it replaces in the same transaction
            try:
                self.index.put(version_key(job, role, step), entry, replacing=(version_key(job, role, s) for s in stale))
            except BaseException:
                remove_sidecar(f"{self._root}/{slot}")
                raise

        self._record(rs, slot, f"the index entry of {role} step {step}", len(entry), commit_point)
        parts = self.commit_parts
        parts.add("checksum", hashed - started)
        parts.add("index", time.perf_counter() - written)
        parts.add("sidecar", written - recorded)
        rs.versions[step] = version
        rs.writing.pop(slot, None)
        dropped = {rs.versions[s].path for s in stale}
        for old in stale:
            remove_sidecar(f"{self._root}/{rs.versions.pop(old).path}")
        if stale:
            self._release_unreferenced(rs, dropped - set(rs.paths))
        if len(rs.statics) > 1:
            self._forget_statics(rs)
        parts.add("total", time.perf_counter() - started)
        parts.done()
        return version

    def _put_static(self, rs: RoleState, static: str, static_header: dict[str, Any]) -> None:
        self.index.put(f"statics/{rs.job}/{rs.role}/{static}", static_header)
        write_sidecar(self._static_file(rs.job, rs.role, static), static_header)
        rs.statics[static] = static_header

    def _record(self, rs: RoleState, slot: str, what: str, size: int, write: Callable[[], None]) -> None:
        """``write`` a commit's record of ``size`` bytes; on a full tmpfs (or index) the commit is
        refused with a ``CapacityError``, the slot is free again and nothing of the step is kept."""
        try:
            write()
        except (OSError, lmdb.Error) as exc:
            if not _no_room(exc):
                raise
            self.abandon(rs.job, rs.role, slot)
            raise shm.no_room(what, size, self.root, exc) from exc

    def _forget_statics(self, rs: RoleState) -> None:
        """Drop static header parts no kept version uses (a layout or model change left them)."""
        unused = set(rs.statics) - {v.static for v in rs.versions.values()}
        for digest in unused:
            del rs.statics[digest]
        if unused:
            self.index.delete(*(f"statics/{rs.job}/{rs.role}/{d}" for d in unused))
        for d in unused:
            remove_sidecar(self._static_file(rs.job, rs.role, d))

    def _static_file(self, job: str, role: str, digest: str) -> Path:
        return self.root / job / "state" / role / f"static-{digest}"

    def _adoptable(self, rs: RoleState, slot: str, settled: bool) -> bool:
        return slot in self._free(rs, settled, frozenset())

    def drop(self, job: str, role: str, step: int) -> None:
        """Forget a committed version that failed its checksum: the slot holds nothing any more
        and is reused by a later save."""
        rs = self.roles.get((job, role))
        version = rs.versions.pop(step, None) if rs is not None else None
        if version is not None:
            self.index.delete(version_key(job, role, step))
            remove_sidecar(self.root / version.path)

    def verify(self, version: Version) -> bool:
        return checksum(memoryview(self.mapped(version.path))[: version.nbytes]) == version.checksum

    async def verify_step(self, versions: dict[str, Version]) -> bool:
        """Whether every shard in ``versions`` still matches its checksum (roles in parallel)."""
        results = await asyncio.gather(*(asyncio.to_thread(self.verify, v) for v in versions.values()))
        return all(results)

    def versions_at(self, job: str, step: int) -> dict[str, Version]:
        return {r: rs.versions[step] for (j, r), rs in self.roles.items() if j == job and step in rs.versions}

    async def restorable(self, job: str, verify: bool = True, below: int | None = None) -> tuple[int | None, dict[str, Version]]:
        """Newest step (< ``below``) committed, and intact, for every role of ``job`` known here.

        With ``verify=False`` the checksums are left to a ``verify_step`` call, so a restoring
        worker can copy while the daemon verifies (restore ≈ max(copy, verify), not the sum).
        """
        roles = {r: rs for (j, r), rs in self.roles.items() if j == job}
        layouts = Layouts()  # a version's layout names its peers, even those never seen here
        for rs in roles.values():
            for v in rs.versions.values():
                # a header naming no layout (a bare control-socket client): every role saving here
                layouts.add(v.step, layout_roles(v.header, rs.role) if "layout_roles" in v.header else roles)
        for step in whole_steps({r: rs.versions for r, rs in roles.items()}, layouts, below):
            chosen = {r: roles[r].versions[step] for r in layouts.of(step)}
            if not verify:
                return step, chosen
            intact = await self.verify_step(chosen)
            if intact:
                return step, chosen
            log.warning("corrupt shard: trying an older step", extra={"job": job, "step": step})
        return None, {}

    def describe(self, replicated: bool = True, parity_k: int = 0) -> list[dict[str, Any]]:
        """Every local role: its slots, versions and what its copies take and survive
        (``replicated``: whether commits go to a ring successor; ``parity_k``: in parity groups of
        that many, its share of the holder's accumulators instead)."""
        out = []
        for rs in self.roles.values():
            newest = rs.newest(len(rs.versions))
            header = newest[0].header if newest else {}
            out.append(
                {
                    "job": rs.job,
                    "role": rs.role,
                    "slots": len(rs.paths),
                    "slot_bytes": rs.size,
                    "writing": sorted(s for s in rs.writing.values() if s != RESERVED),
                    "reserved": sum(1 for s in rs.writing.values() if s == RESERVED),
                    "unique_bytes": header.get("unique_nbytes"),
                    "memory": self._memory(rs, newest[0].nbytes if newest else rs.size, replicated, parity_k),
                    "razored_bytes": newest[0].nbytes if newest else None,
                    "versions": [
                        {
                            "step": v.step,
                            "nbytes": v.nbytes,
                            "checksum": v.checksum,
                            "algorithm": ALGORITHM,
                            "slot": v.path,
                            "save_block_s": round(v.save_block_s, 6),
                            "commit_s": round(v.commit_s, 6),
                            "committed_at": v.committed_at,
                        }
                        for v in newest
                    ],
                }
            )
        return out

    def _memory(self, rs: RoleState, shard: int, replicated: bool, parity_k: int) -> dict[str, Any]:
        """Shared memory the role takes: its slots here, and (by the rule its successor keeps,
        ``statestore.retention``) its replica files there, or its share of its group's parity;
        as a multiple of its razored shard."""
        settled = rs.settled is not False  # a role that has not saved yet is counted as settling
        here = len(rs.paths) * rs.size
        successor = retention.files(self.versions, settled) * rs.size // max(parity_k, 1) if replicated else 0
        return {
            "here_bytes": here,
            "successor_bytes": successor,
            "shard_bytes": shard,
            "multiple": round((here + successor) / max(shard, 1), 3),
            "settled": rs.settled,
            "survives": retention.survives(replicated, settled, parity_k),
        }


def _static_intact(key: str, static: dict[str, Any], digest: str) -> bool:
    """Whether a header's static part read back from the index is the one its digest names."""
    if static_digest(static) == digest:
        return True
    log.error("a static header part does not match its digest: dropped, with the versions that use it", extra={"key": key})
    return False


def _prefault(path: Path, size: int) -> None:
    """Create ``path`` with every page of ``size`` allocated now (first touch off the save path)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        shm.reserve(fd, size, f"a slot {path.name}", path.parent)
    except CapacityError:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def _no_room(exc: BaseException) -> bool:
    """Whether ``exc`` says the tmpfs (or the index's map) is full."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(exc, lmdb.MapFullError) or os.strerror(errno.ENOSPC) in str(exc)
