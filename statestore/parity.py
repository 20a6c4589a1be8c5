"""Parity replicas (``--parity-k K``): instead of a whole copy of each shard on the ring
successor, the nodes of a group of K (``ffplane_contract.ring.parity_group``) push their shards
to the group's parity holder, which XORs them into one *accumulator* per step and lane (a lane
takes at most one shard of each member node: the shards of a node's several roles go to several
lanes). A lost node's shard is rebuilt from the accumulator and the other members' shards of the
same step (``rebuild``), and checked against the checksum and header digest its primary
recorded. Memory per role: its ``versions`` slots plus ``versions``/K accumulators, where a
whole replica costs ``versions``; a restore of a lost role moves K shards instead of one.

An accumulator is a tmpfs file of the largest member's size, zero-filled when made (zero is
XOR's identity); each member's bytes are XORed in as they arrive and hashed, and the member
counts once its checksum matches. A member whose bytes do not match poisons the accumulator
(bytes XORed in cannot be taken out): it is dropped, with what the others gave it.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ffplane_contract.checksum import streaming_checksum
from ffplane_contract.errors import CapacityError, CorruptError, FFPlaneError, TransferOrderError
from ffplane_contract.shard import header_digest
from statestore import retention, shm
from statestore.index import Index

log = logging.getLogger(__name__)
_KEY = "parity/"  # index: parity/<job>/<group>/<lane>/<step> → the accumulator's record


@dataclass
class Member:
    """One shard XORed into an accumulator, as its primary recorded it."""

    role: str
    step: int
    source: str  # the node it came from
    nbytes: int
    checksum: str
    header: dict[str, Any]
    header_digest: str = ""


@dataclass
class Accumulator:
    job: str
    group: str  # the group's members, comma-separated
    lane: int
    step: int
    path: str  # relative to the root
    size: int = 0
    members: dict[str, Member] = field(default_factory=dict)  # role → its verified contribution
    arriving: dict[str, str] = field(default_factory=dict)  # role → source, XORed in part
    mm: mmap.mmap | None = None

    def sources(self) -> set[str]:
        return {m.source for m in self.members.values()} | set(self.arriving.values())


@dataclass
class _Arrival:
    acc: Accumulator
    member: Member
    received: int = 0
    hasher: Any = field(default_factory=streaming_checksum)
    touched: float = field(default_factory=time.monotonic)


class ParityStore:
    def __init__(
        self, root: Path, index: Index, k: int, versions: int, group_of: Callable[[str], tuple[str, ...]], free: Callable[[], int]
    ) -> None:
        """``group_of(node)``: the parity group of a member node, by this daemon's ring view;
        ``free()``: what is left of the daemon's budget."""
        self.root, self.index, self.k, self.versions, self.free = root, index, k, versions, free
        self.group_of = group_of
        self.accs: dict[tuple[str, str, int, int], Accumulator] = {}
        self._arrivals: dict[tuple[str, str, int], _Arrival] = {}
        self.xored_bytes = 0

    # --- receiving -----------------------------------------------------------------------
    def begin(
        self, job: str, role: str, step: int, nbytes: int, digest: str, header: dict[str, Any], source: str, header_digest_: str
    ) -> int:
        """Start (or resume) a member's push; the offset to send from."""
        group = ",".join(self.group_of(source))
        for acc in self._of(job, step):
            m = acc.members.get(role)
            if m is not None and m.checksum == digest and acc.group == group:
                return nbytes  # here already, verified, in the group it is in now
        arrival = self._arrivals.get((job, role, step))
        if arrival is not None and arrival.member.checksum == digest and arrival.member.nbytes == nbytes:
            return arrival.received
        if arrival is not None:  # another version of the same step: what it XORed in cannot come out
            self._poison(arrival.acc, f"{role} step {step} began again with other bytes")
        settled = header.get("settled") is True
        self._retire(job, below=step - retention.kept_while_writing(self.versions, settled))
        acc = self._lane_for(job, group, step, source)
        self._fit(acc, nbytes)
        acc.arriving[role] = source
        self._record(acc)  # a restart finding it arriving drops the accumulator: part of its bytes are in
        self._arrivals[(job, role, step)] = _Arrival(acc, Member(role, step, source, nbytes, digest, header, header_digest_))
        return 0

    async def receive(self, job: str, role: str, step: int, offset: int, body: AsyncIterator[bytes | memoryview]) -> int:
        a = self._arrivals.get((job, role, step))
        if a is None:
            raise TransferOrderError(f"no transfer of {role} step {step} in progress; send 'begin' first")
        if offset != a.received:
            raise TransferOrderError(f"body at offset {offset} but {a.received} bytes received so far; resume from there")
        assert a.acc.mm is not None
        out = np.frombuffer(a.acc.mm, dtype=np.uint8)
        async for piece in body:
            n = len(piece)
            if a.received + n > a.member.nbytes:
                raise FFPlaneError(f"body runs past the shard's {a.member.nbytes} bytes")
            part = out[a.received : a.received + n]
            np.bitwise_xor(part, np.frombuffer(piece, dtype=np.uint8), out=part)
            a.hasher.update(piece)
            a.received += n
            a.touched = time.monotonic()
            self.xored_bytes += n
        return a.received

    def finish(self, job: str, role: str, step: int) -> Member:
        a = self._arrivals.get((job, role, step))
        if a is None:
            for acc in self._of(job, step):
                if role in acc.members:
                    return acc.members[role]
            raise TransferOrderError(f"no transfer of {role} step {step} to finish")
        if a.received != a.member.nbytes:
            raise TransferOrderError(f"only {a.received} of {a.member.nbytes} bytes of {role} step {step} received")
        del self._arrivals[(job, role, step)]
        acc, m = a.acc, a.member
        acc.arriving.pop(role, None)
        if a.hasher.hexdigest() != m.checksum or (m.header_digest and header_digest(m.header) != m.header_digest):
            self._poison(acc, f"{role} step {step} arrived corrupt")
            raise CorruptError(f"{role} step {step} arrived corrupt; discarded with its parity, send it again")
        acc.members[role] = m
        self._record(acc)
        return m

    def purge(self, idle_s: float) -> None:
        """A push idle this long (its sender died or stalled) holds part of a member no one can
        take out: its accumulator goes, as for a transfer of a whole replica."""
        now = time.monotonic()
        for a in [a for a in self._arrivals.values() if now - a.touched > idle_s]:
            self._poison(a.acc, f"a push of {a.member.role} step {a.member.step} idle for {idle_s:.0f} s")

    # --- what is held ----------------------------------------------------------------------
    def covers(self, job: str, role: str, step: int) -> Accumulator | None:
        """The accumulator that can rebuild ``role``'s shard of ``step``, if any: one a push is
        still XORing into (its sender died mid-push, or has not finished) holds part of a member
        no one can take out, and rebuilds nothing."""
        return next((acc for acc in self._of(job, step) if role in acc.members and not acc.arriving), None)

    def inventory(self, job: str) -> dict[str, list[Member]]:
        out: dict[str, list[Member]] = {}
        for (j, _g, _l, _s), acc in self.accs.items():
            if j == job:
                for m in acc.members.values():
                    out.setdefault(m.role, []).append(m)
        return out

    def jobs(self) -> set[str]:
        return {key[0] for key in self.accs}

    def held_bytes(self) -> int:
        return sum(acc.size for acc in self.accs.values())

    def memory(self) -> dict[str, Any]:
        roles = sorted({f"{acc.job}/{r}" for acc in self.accs.values() for r in (*acc.members, *acc.arriving)})
        return {
            "accumulators": len(self.accs),
            "bytes": self.held_bytes(),
            "roles": len(roles),
            "covers": roles[:256],  # job/role whose shard these accumulators can rebuild
            "xored_bytes": self.xored_bytes,
        }

    # --- rebuilding ------------------------------------------------------------------------
    def others(self, acc: Accumulator, role: str) -> list[Member]:
        return [m for r, m in sorted(acc.members.items()) if r != role]

    def xor_into(self, out: bytearray, data: memoryview | bytes) -> None:
        """``out`` ^= ``data`` over ``data``'s length (a shard shorter than the accumulator)."""
        o = np.frombuffer(out, dtype=np.uint8, count=len(data))
        np.bitwise_xor(o, np.frombuffer(data, dtype=np.uint8), out=o)

    def start(self, acc: Accumulator) -> bytearray:
        """A copy of the accumulator: the rebuild's start."""
        assert acc.mm is not None
        return bytearray(acc.mm[: acc.size])

    # --- lifecycle -------------------------------------------------------------------------
    def reattach(self) -> int:
        """Adopt the accumulators the index records whose files are whole; one a push was XORing
        into when the daemon went is dropped (its bytes are part of no member)."""
        n = 0
        for key, entry in self.index.items(_KEY):
            path = self.root / entry["path"]
            if entry.get("arriving") or not path.is_file() or path.stat().st_size < entry["size"]:
                self.index.delete(key)
                shm.unlink(str(path))
                continue
            acc = Accumulator(entry["job"], entry["group"], entry["lane"], entry["step"], entry["path"], entry["size"])
            acc.members = {r: Member(**m) for r, m in entry["members"].items()}
            acc.mm = self._map(acc)
            self.accs[(acc.job, acc.group, acc.lane, acc.step)] = acc
            n += 1
        return n

    def close(self) -> None:
        for acc in self.accs.values():
            _close(acc.mm)
            acc.mm = None

    def _of(self, job: str, step: int) -> list[Accumulator]:
        return [acc for (j, _g, _l, s), acc in self.accs.items() if j == job and s == step]

    def _retire(self, job: str, below: int) -> None:
        """A push of a step says no restore of the job can need a step below ``below`` (every
        role's last save before it was answered: ``retention.kept_while_writing``): the
        accumulators of those go, in every group (a group a ring change left behind too)."""
        for acc in [a for (j, _g, _l, s), a in self.accs.items() if j == job and s < below]:
            self._drop(acc)

    def _lane_for(self, job: str, group: str, step: int, source: str) -> Accumulator:
        """The first lane of (job, group, step) without a shard from ``source``."""
        lane = 0
        while True:
            acc = self.accs.get((job, group, lane, step))
            if acc is None:
                rel = f"{job}/parity/{_safe(group)}/{lane}/{step:012d}.bin"
                acc = Accumulator(job, group, lane, step, rel)
                shm.private_dir((self.root / rel).parent)
                self.accs[(job, group, lane, step)] = acc
                return acc
            if source not in acc.sources():
                return acc
            lane += 1

    def _fit(self, acc: Accumulator, nbytes: int) -> None:
        """Grow the accumulator's file to ``nbytes`` (new bytes are zero: XOR's identity)."""
        if nbytes <= acc.size and acc.mm is not None:
            return
        if nbytes - acc.size > self.free():
            if not acc.members and not acc.arriving:
                self._drop(acc)
            raise CapacityError(
                f"no room for a {nbytes / 2**20:.1f} MiB parity of step {acc.step}: "
                f"{max(self.free(), 0) / 2**20:.1f} MiB of the daemon's budget left; raise --budget-mb",
            )
        path = self.root / acc.path
        fd = shm.open_private(str(path), os.O_RDWR | os.O_CREAT)
        try:
            if nbytes > acc.size:
                shm.presize(fd, nbytes)
                acc.size = nbytes
        finally:
            os.close(fd)
        _close(acc.mm)
        acc.mm = self._map(acc)
        self._record(acc)

    def _map(self, acc: Accumulator) -> mmap.mmap:
        fd = os.open(str(self.root / acc.path), os.O_RDWR)
        try:
            return mmap.mmap(fd, max(acc.size, 1))
        finally:
            os.close(fd)

    def _record(self, acc: Accumulator) -> None:
        self.index.put(
            f"{_KEY}{acc.job}/{_safe(acc.group)}/{acc.lane}/{acc.step:012d}",
            {
                "job": acc.job,
                "group": acc.group,
                "lane": acc.lane,
                "step": acc.step,
                "path": acc.path,
                "size": acc.size,
                "arriving": sorted(acc.arriving),
                "members": {r: vars(m) for r, m in acc.members.items()},
            },
        )

    def _poison(self, acc: Accumulator, why: str) -> None:
        log.warning("a parity accumulator is dropped", extra={"job": acc.job, "step": acc.step, "lane": acc.lane, "why": why})
        self._drop(acc)

    def _drop(self, acc: Accumulator) -> None:
        self.accs.pop((acc.job, acc.group, acc.lane, acc.step), None)
        for key in [k for k, a in self._arrivals.items() if a.acc is acc]:
            del self._arrivals[key]
        _close(acc.mm)
        acc.mm = None
        self.index.delete(f"{_KEY}{acc.job}/{_safe(acc.group)}/{acc.lane}/{acc.step:012d}")
        shm.unlink(str(self.root / acc.path))


def _safe(group: str) -> str:
    """A group as one path part and index key part: its digest (sixteen node ids of 128
    characters would be longer than a file name may be)."""
    return xxhash.xxh3_64_hexdigest(group.encode())


def _close(mm: mmap.mmap | None) -> None:
    """Unmap, unless a push is XORing into it right now: its view keeps the mapping (of a file
    already unlinked) until it lets go."""
    if mm is not None:
        with contextlib.suppress(BufferError):
            mm.close()
