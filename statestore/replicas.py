"""Shards this daemon holds for roles that do not save here: replicas pushed by the ring
predecessor and shards pulled for a restore.

A shard arrives in chunks into ``<root>/<job>/replica/<role>/<step>.part``; the sender may stop
and resume at the offset the receiver reports. Only when every byte is in and the whole-shard
checksum matches is it renamed to ``.bin`` and recorded in the LMDB index — a replica counts
(inventory, restore) only from then on. As many versions per role are kept as its primary keeps
(``statestore.retention``): 2 by default, 3 while its saves are not settled.

When a push begins, the role's oldest replica that no role can need any more gives way (the
push's header says whether the save was settled: ``retention.kept_while_writing``); its file is
kept as the role's spare, mapped writable, and the push lands in it: fresh tmpfs pages cost more
to allocate and zero than the bytes cost to receive (``bench/save_cpu.py``: 0.84-1.10 s/GiB
received into a new file, 0.20-0.23 into one whose pages exist; docs/decisions.md "Replicas on a
bulk channel, received into a reused file"). That happens only while the role's primary saves —
and then nothing restores that role from the version retired.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ffplane_contract.checksum import streaming_checksum
from ffplane_contract.errors import CapacityError, CorruptError, FFPlaneError, StaticHeaderUnknownError, TransferOrderError
from ffplane_contract.shard import PER_STEP, header_digest, header_intact, static_digest
from ffplane_runtime.pagemap import populate_write
from statestore import retention, shm
from statestore.budget import REPLICAS_HOLDER, Budget
from statestore.index import Index, encode, remove_sidecar, write_sidecar
from statestore.latencies import Parts
from statestore.parity import ParityStore

log = logging.getLogger(__name__)
SPARE = "spare.bin"  # a role's retired replica file, kept for its next push
STATICS_KEY = "rstatics/"  # index keys of replicas' static header parts: rstatics/<job>/<role>/<digest>


@dataclass
class Replica:
    job: str
    role: str
    step: int
    path: str  # relative to the root
    nbytes: int
    checksum: str
    header: dict[str, Any]
    source: str  # the node it came from
    kind: str = "replica"  # "replica" (pushed to us) or "pulled" (fetched for a restore)
    complete_at: float = 0.0
    static: str = ""  # digest of the header's static part, held once per role (``ReplicaStore.statics``); "" if whole
    header_digest: str = ""  # of the whole header, as its primary recorded it: checked with the checksum

    def index_entry(self) -> dict[str, Any]:
        """What the index and the sidecar record: the header without its static part, which is
        recorded once per role under its digest."""
        entry = dict(vars(self))  # shallow: the header is not copied
        if self.static:
            entry["header"] = {k: v for k, v in self.header.items() if k in PER_STEP}
        return entry


@dataclass
class _Incoming:
    meta: Replica
    received: int = 0
    touched: float = field(default_factory=time.monotonic)
    hasher: Any = field(default_factory=streaming_checksum)  # over bytes 0..received, as they arrive
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    sink: mmap.mmap | None = None  # the .part file mapped writable (a reused spare's, or made for a bulk receive)
    owner: Any = None  # the bulk connection holding ``lock`` (one whose sender stalled may be taken over)


@dataclass
class _Spare:
    """A retired replica file of a role, kept for its next push (its pages are allocated)."""

    rel: str
    size: int
    mm: mmap.mmap | None  # mapped writable with every page touched, or None (mapped on first use)


def _key(job: str, role: str, step: int) -> str:
    return f"replica/{job}/{role}/{step:012d}"


class ReplicaStore:
    def __init__(
        self, root: Path, index: Index, budget: Budget, versions: int = retention.DEFAULT_VERSIONS, parity: ParityStore | None = None
    ) -> None:
        """``budget``: the daemon's one ledger, shared with the data cache and the slots; the
        replicas count in it as ``replicas``. ``versions``: as the primaries' (``--versions``).
        ``parity``: pushed replicas are XORed into parity accumulators there (``--parity-k``)."""
        self.versions, self.parity = versions, parity
        self.root = root
        self._root = str(root)  # the per-push paths are strings (see index.write_sidecar)
        self.index = index
        self.budget = budget
        self.complete: dict[tuple[str, str], dict[int, Replica]] = {}
        self._incoming: dict[tuple[str, str, int], _Incoming] = {}
        self._maps: dict[str, mmap.mmap] = {}
        self._writable: set[str] = set()  # paths whose mapping in _maps is a former sink (writable)
        self._spares: dict[tuple[str, str], _Spare] = {}
        self.statics: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}  # (job, role) → digest → static header part
        self.received_bytes = 0
        self.reused_files = 0  # receives that landed in a spare instead of a fresh file
        self.finish_parts = Parts()  # where making a received replica count goes (/v1/state)
        budget.register(REPLICAS_HOLDER, self.held_bytes)

    def reattach(self) -> int:
        n = 0
        for key, entry in self.index.items(STATICS_KEY):
            _, job, role, digest = key.split("/")
            if static_digest(entry) == digest:  # else changed at rest: the replicas using it go too
                self.statics.setdefault((job, role), {})[digest] = entry
        for key, entry in self.index.items("replica/"):
            r = Replica(**entry)
            f = self.root / r.path
            static = self.statics.get((r.job, r.role), {}).get(r.static) if r.static else {}
            if (
                static is not None
                and f.is_file()
                and f.stat().st_size == r.nbytes
                and header_intact({**static, **r.header}, r.header_digest)
            ):
                r.header = {**static, **r.header}
                self.complete.setdefault((r.job, r.role), {})[r.step] = r
                n += 1
            else:
                if static is None or f.is_file():
                    log.error("a replica's header does not match its digest: dropped", extra={"job": r.job, "role": r.role, "step": r.step})
                self.index.delete(key)
        for job, role in list(self.statics):
            self._forget_statics(job, role)
        for part in self.root.glob("*/replica/*/*.part"):  # senders restart those from zero
            part.unlink(missing_ok=True)
        for spare in self.root.glob(f"*/replica/*/{SPARE}"):
            spare.unlink(missing_ok=True)
        held = {r.path for versions in self.complete.values() for r in versions.values()}
        for f in self.root.glob("*/replica/*/*.bin"):  # a crash between an index change and the files it describes
            if str(f.relative_to(self.root)) not in held:
                f.unlink(missing_ok=True)
                remove_sidecar(f)
        return n

    def held_bytes(self) -> int:
        held = sum(r.nbytes for versions in self.complete.values() for r in versions.values())
        held += self.parity.held_bytes() if self.parity is not None else 0
        return held + sum(i.meta.nbytes for i in self._incoming.values()) + sum(s.size for s in self._spares.values())

    def get(self, job: str, role: str, step: int) -> Replica | None:
        return self.complete.get((job, role), {}).get(step)

    def mapped(self, rel: str) -> mmap.mmap:
        mm = self._maps.get(rel)
        if mm is None:
            fd = os.open(self.root / rel, os.O_RDONLY)
            try:
                mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ) if os.fstat(fd).st_size else mmap.mmap(-1, 1)
            finally:
                os.close(fd)
            self._maps[rel] = mm
        return mm

    # --- receiving -----------------------------------------------------------------------
    def begin(
        self,
        job: str,
        role: str,
        step: int,
        nbytes: int,
        digest: str,
        header: dict[str, Any],
        source: str,
        kind: str = "replica",
        static: str = "",
        static_header: dict[str, Any] | None = None,
        header_digest: str = "",
    ) -> int:
        """Start (or resume) receiving a shard; returns the offset to send from. ``static``: the
        digest of the header's static part, which ``header`` then leaves out; it comes as
        ``static_header`` only when this store may not have it (unknown: 428, send it)."""
        if nbytes < 0:
            raise FFPlaneError(f"a shard cannot have {nbytes} bytes", 422)
        if self.get(job, role, step) is not None and self.get(job, role, step).checksum == digest:  # type: ignore[union-attr]
            return nbytes  # already here, complete and verified
        if static:
            header = {**self._static(job, role, static, static_header), **header}
        self._purge()
        if self.parity is not None and kind == "replica":
            return self.parity.begin(job, role, step, nbytes, digest, header, source, header_digest)
        key = (job, role, step)
        inc = self._incoming.get(key)
        if inc is not None and (inc.meta.checksum != digest or inc.meta.nbytes != nbytes):
            self._drop_incoming(key)  # another version of the same step: start over
            inc = None
        if inc is None:
            if kind == "replica":
                self._make_way(job, role, step, header.get("settled") is True)
            spare = self._spares.pop((job, role), None)
            if spare is not None and spare.size != nbytes:
                # never truncated: a reader of the version it held may still be copying from it
                self._unlink_spare(spare)
                spare = None
            # a spare of this size is counted as held already: landing in it takes nothing new
            # from the budget, which is asked (a walk over the cache, slots and replicas) only without one
            room = nbytes if spare is not None else self.budget.free()
            if nbytes > room and self._spares:  # other roles' spares give way first
                self._release_spares()
                room = self.budget.free()
            if nbytes > room:
                raise CapacityError(
                    f"no room for a {nbytes / 2**20:.1f} MiB replica of {role} step {step}: "
                    f"{max(room, 0) / 2**20:.1f} MiB of the daemon's budget left; raise --budget-mb",
                )
            rel = f"{job}/replica/{role}/{step:012d}"
            part = self._at(f"{rel}.part")
            sink = None
            if spare is not None:
                os.rename(self._at(spare.rel), part)
                sink = spare.mm
                self.reused_files += 1
            else:
                shm.private_dir(Path(part).parent)
                fd = shm.open_private(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                try:
                    shm.presize(fd, nbytes)
                finally:
                    os.close(fd)
            inc = _Incoming(
                Replica(job, role, step, f"{rel}.bin", nbytes, digest, header, source, kind, static=static, header_digest=header_digest),
                sink=sink,
            )
            self._incoming[key] = inc
        return inc.received

    def _make_way(self, job: str, role: str, step: int, settled: bool) -> None:
        """A push of ``step`` begins: retire the role's older replicas beyond those kept while
        it arrives (``retention.kept_while_writing``); the oldest becomes the spare it lands in."""
        versions = self.complete.get((job, role), {})
        older = sorted((s for s, r in versions.items() if r.kind == "replica" and s < step), reverse=True)
        stale = older[retention.kept_while_writing(self.versions, settled) :]
        if stale:
            self.index.delete(*(_key(job, role, s) for s in stale))
            for s in stale:  # the first becomes the spare (if the role has none), the rest go
                self._retire(versions.pop(s))

    def _static(self, job: str, role: str, digest: str, given: dict[str, Any] | None) -> dict[str, Any]:
        known = self.statics.setdefault((job, role), {})
        if digest not in known:
            if given is None:
                raise StaticHeaderUnknownError(f"static header {digest} of {role} is not known here; send it with the push")
            if static_digest(given) != digest:
                raise CorruptError(f"the static header sent for {role} is not the one its digest {digest} names; discarded, send it again")
            known[digest] = given
            self.index.put(f"{STATICS_KEY}{job}/{role}/{digest}", given)
            file = self.static_file(job, role, digest)
            shm.private_dir(file.parent)  # a role's first push
            write_sidecar(file, given)
        return known[digest]

    def static_file(self, job: str, role: str, digest: str) -> Path:
        return self.root / job / "replica" / role / f"static-{digest}"

    def _forget_statics(self, job: str, role: str) -> None:
        """Drop static header parts no replica of the role, held or arriving, uses."""
        used = {r.static for r in self.complete.get((job, role), {}).values()}
        used |= {i.meta.static for (j, r, _), i in self._incoming.items() if (j, r) == (job, role)}
        known = self.statics.get((job, role), {})
        for digest in set(known) - used:
            del known[digest]
            self.index.delete(f"{STATICS_KEY}{job}/{role}/{digest}")
            remove_sidecar(self.static_file(job, role, digest))
        if not known:
            self.statics.pop((job, role), None)

    def _at(self, rel: str) -> str:
        return f"{self._root}/{rel}"

    def sink(self, job: str, role: str, step: int) -> tuple[_Incoming, memoryview]:
        """A transfer begun here, and its whole file mapped writable: a bulk receive lands the
        bytes there straight from the socket and reports them with ``landed``."""
        inc = self._incoming.get((job, role, step))
        if inc is None:
            raise TransferOrderError(f"no transfer of {role} step {step} in progress; send 'begin' first")
        if inc.meta.nbytes == 0:
            return inc, memoryview(b"")
        if inc.sink is None:
            fd = os.open(self._at(inc.meta.path.replace(".bin", ".part")), os.O_RDWR)
            try:
                # the pages now, or a refusal now: on a full tmpfs the bytes landing in an
                # unbacked mapping failed the receive midway (the sender saw a reset, not why)
                shm.reserve(fd, inc.meta.nbytes, f"a replica of {role} step {step}", self.root)
                inc.sink = mmap.mmap(fd, max(inc.meta.nbytes, 1))
            except CapacityError:
                self._drop_incoming((job, role, step))
                raise
            finally:
                os.close(fd)
            populate_write(inc.sink)
        return inc, memoryview(inc.sink)[: inc.meta.nbytes]

    def sink_mapped(self, job: str, role: str, step: int) -> bool:
        """Whether ``sink`` has the transfer's file mapped already (a reused spare): no pages to allocate."""
        inc = self._incoming.get((job, role, step))
        return inc is not None and (inc.sink is not None or inc.meta.nbytes == 0)

    def landed(self, inc: _Incoming, piece: memoryview) -> None:
        """``piece``, the next bytes of ``inc`` in order, is in its file: hash it while it is in cache."""
        inc.hasher.update(piece)
        inc.received += len(piece)
        self.received_bytes += len(piece)
        inc.touched = time.monotonic()

    async def receive(self, job: str, role: str, step: int, offset: int, body: AsyncIterator[bytes | memoryview]) -> int:
        """Write a streamed body from ``offset`` on; what arrived before a cut-off counts, so
        the sender resumes from there. Returns the bytes received so far."""
        inc = self._incoming.get((job, role, step))
        if inc is None and self.parity is not None:
            return await self.parity.receive(job, role, step, offset, body)
        if inc is None:
            raise TransferOrderError(f"no transfer of {role} step {step} in progress; send 'begin' first")
        async with inc.lock:
            if offset != inc.received:
                raise TransferOrderError(f"body at offset {offset} but {inc.received} bytes received so far; resume from there")
            fd = os.open(self._at(inc.meta.path.replace(".bin", ".part")), os.O_WRONLY)
            out = shm.PageWriter(fd, inc.received, on_write=inc.hasher.update)
            arrived = inc.received
            try:
                async for piece in body:
                    if arrived + len(piece) > inc.meta.nbytes:
                        raise FFPlaneError(f"body runs past the shard's {inc.meta.nbytes} bytes")
                    out.add(piece)
                    arrived += len(piece)
                    inc.touched = time.monotonic()
            finally:
                try:
                    out.flush()  # what arrived before a cut-off is kept: the sender resumes after it
                finally:
                    os.close(fd)
                    self.received_bytes += out.offset - inc.received
                    inc.received = out.offset
            return inc.received

    async def write(self, job: str, role: str, step: int, offset: int, data: bytes | memoryview) -> int:
        """One chunk at ``offset`` (a pull's piece): ``receive`` with a body of one piece."""

        async def one() -> AsyncIterator[bytes | memoryview]:
            yield data

        return await self.receive(job, role, step, offset, one())

    async def finish(self, job: str, role: str, step: int, newest: int | None = None) -> Replica:
        """Make a fully received shard count, once its checksum matches. ``newest``: the sender's
        newest committed step of the role; replicas above it are a discarded future."""
        key = (job, role, step)
        inc = self._incoming.get(key)
        if inc is None:
            done = self.get(job, role, step)
            if done is not None:
                return done
            if self.parity is not None:
                m = self.parity.finish(job, role, step)
                return Replica(job, role, step, "", m.nbytes, m.checksum, m.header, m.source, kind="parity")
            raise TransferOrderError(f"no transfer of {role} step {step} to finish")
        async with inc.lock:
            started = time.perf_counter()
            r = inc.meta
            if inc.received != r.nbytes:
                raise TransferOrderError(f"only {inc.received} of {r.nbytes} bytes of {role} step {step} received")
            part = self._at(r.path.replace(".bin", ".part"))
            digest = inc.hasher.hexdigest()  # hashed while it arrived: no second pass
            self._incoming.pop(key, None)
            if digest != r.checksum or (r.header_digest and header_digest(r.header, r.static) != r.header_digest):
                _close(inc.sink)
                shm.unlink(part)
                what = f"checksum {digest}, expected {r.checksum}" if digest != r.checksum else "a header that does not match its digest"
                raise CorruptError(f"{role} step {step} arrived with {what}; discarded, send it again")
            self._forget_map(r.path)  # a replaced version's old mapping must not serve its bytes
            os.rename(part, self._at(r.path))
            if inc.sink is not None:  # readable too: reads (a pull, a forward) need no mapping of their own
                self._maps[r.path] = inc.sink
                self._writable.add(r.path)
            r.complete_at = time.time()
            versions = self.complete.setdefault((job, role), {})
            steps = {*versions, step}
            # as with slots: a "future" the primary rewound from (it restored an older step and
            # saves again) must not outrank what it saves now
            stale = [s for s in steps if s > newest] if newest is not None else []
            stale += sorted(s for s in steps if s not in stale)[: -retention.files(self.versions, r.header.get("settled") is True)]
            stale = [s for s in stale if s != step]  # what was just asked for stays (a restore may want an older step)
            recorded = time.perf_counter()
            entry = encode(r.index_entry())  # once, for the index and the sidecar
            # the index forgets what this replaces in the same transaction, before their files go:
            # a crash leaves no entry for a deleted file
            self.index.put(_key(job, role, step), entry, replacing=(_key(job, role, s) for s in stale))
            indexed = time.perf_counter()
            write_sidecar(self._at(r.path), entry)  # what a rebuild of a lost index adopts (after verifying it)
            self.finish_parts.add("index", indexed - recorded)
            self.finish_parts.add("sidecar", time.perf_counter() - indexed)
            versions[step] = r
            for s in stale:
                self._retire(versions.pop(s))
            self._purge()
            if len(self.statics.get((job, role), {})) > 1:
                self._forget_statics(job, role)
            self.finish_parts.add("total", time.perf_counter() - started)
            self.finish_parts.done()
            # a push per role per step is counted in /v1/state and /metrics; a line each only when asked
            (log.info if r.kind == "pulled" else log.debug)(
                "shard received", extra={"job": job, "role": role, "step": step, "bytes": r.nbytes, "from": r.source, "kind": r.kind}
            )
            return r

    def _purge(self, idle_s: float = 60.0) -> None:
        """Drop transfers that can no longer count: a push older than both kept versions of its
        role (the sender moved on), or any transfer idle for a minute (the sender died). A pull
        is never too old: a restore asks for the older step on purpose (the soak found pulls
        dropped here, restarted, and dropped again, for ever)."""
        now = time.monotonic()
        if self.parity is not None:
            self.parity.purge(idle_s)
        for key, inc in list(self._incoming.items()):
            job, role, step = key
            kept = self.complete.get((job, role), {})
            superseded = inc.meta.kind != "pulled" and len(kept) >= retention.MIN_VERSIONS and step < min(kept)
            if superseded or now - inc.touched > idle_s:
                if not inc.lock.locked():
                    self._drop_incoming(key)

    def _drop_incoming(self, key: tuple[str, str, int]) -> None:
        inc = self._incoming.pop(key)
        _close(inc.sink)
        shm.unlink(self._at(inc.meta.path.replace(".bin", ".part")))

    def _forget_map(self, rel: str) -> None:
        self._writable.discard(rel)
        _close(self._maps.pop(rel, None))

    def _retire(self, r: Replica) -> None:
        """A version that gave way to newer ones: its file becomes the role's spare (pushed
        replicas), or goes."""
        key = (r.job, r.role)
        if r.kind != "replica" or key in self._spares:
            self._unlink(r)
            return
        mm = self._maps.pop(r.path, None)
        if r.path not in self._writable:
            _close(mm)
            mm = None
        self._writable.discard(r.path)
        spare = f"{r.job}/replica/{r.role}/{SPARE}"
        os.rename(self._at(r.path), self._at(spare))
        remove_sidecar(self._at(r.path))
        self._spares[key] = _Spare(spare, r.nbytes, mm)

    def _release_spares(self) -> None:
        for s in self._spares.values():
            self._unlink_spare(s)
        self._spares.clear()

    def _unlink_spare(self, spare: _Spare) -> None:
        _close(spare.mm)
        shm.unlink(self._at(spare.rel))

    def _unlink(self, r: Replica) -> None:
        self._forget_map(r.path)
        shm.unlink(self._at(r.path))
        remove_sidecar(self._at(r.path))

    def drop(self, job: str, role: str, step: int) -> None:
        """Forget a replica or pulled shard that failed its checksum (its file goes too)."""
        r = self.complete.get((job, role), {}).pop(step, None)
        if r is not None:
            self.index.delete(_key(job, role, step))
            self._unlink(r)

    def drop_pulled(self, job: str, below: int) -> None:
        """Shards pulled for a restore are obsolete once the job has committed a newer step here."""
        for (j, role), versions in list(self.complete.items()):
            if j != job:
                continue
            stale = [s for s, r in versions.items() if r.kind == "pulled" and s < below]
            if stale:
                self.index.delete(*(_key(j, role, s) for s in stale))
            for s in stale:
                self._unlink(versions.pop(s))

    def memory(self) -> list[dict[str, Any]]:
        """Per role held here: the bytes of its replica files (kept, arriving, its spare), how
        many, and their multiple of its shard (its newest replica's size)."""
        held: dict[tuple[str, str], list[int]] = {}  # → [bytes, files, shard bytes]
        for key, versions in self.complete.items():
            for r in versions.values():
                h = held.setdefault(key, [0, 0, 0])
                h[0], h[1], h[2] = h[0] + r.nbytes, h[1] + 1, max(h[2], r.nbytes)
        for (job, role, _), inc in self._incoming.items():
            h = held.setdefault((job, role), [0, 0, 0])
            h[0], h[1], h[2] = h[0] + inc.meta.nbytes, h[1] + 1, max(h[2], inc.meta.nbytes)
        for key, spare in self._spares.items():
            h = held.setdefault(key, [0, 0, 0])
            h[0], h[1] = h[0] + spare.size, h[1] + 1
        return [
            {"job": job, "role": role, "bytes": b, "files": n, "shard_bytes": shard, "multiple": round(b / max(shard, 1), 3)}
            for (job, role), (b, n, shard) in sorted(held.items())
        ]

    def describe(self) -> list[dict[str, Any]]:
        out = []
        for (job, role), versions in sorted(self.complete.items()):
            for r in sorted(versions.values(), key=lambda v: -v.step):
                out.append(
                    {"job": job, "role": role, "step": r.step, "nbytes": r.nbytes, "checksum": r.checksum, "from": r.source, "kind": r.kind}
                )
        for (job, role, step), inc in sorted(self._incoming.items()):
            out.append(
                {
                    "job": job,
                    "role": role,
                    "step": step,
                    "nbytes": inc.meta.nbytes,
                    "received": inc.received,
                    "from": inc.meta.source,
                    "kind": "incoming",
                }
            )
        return out

    def close(self) -> None:
        for mm in self._maps.values():
            _close(mm)
        self._maps.clear()
        for inc in self._incoming.values():
            _close(inc.sink)
        for s in self._spares.values():
            _close(s.mm)


def _close(mm: mmap.mmap | None) -> None:
    if mm is not None:
        try:
            mm.close()
        except BufferError:
            pass  # a reader still holds a view; the mapping goes when it does
