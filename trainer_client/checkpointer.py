"""The state API: ``save(step, state)`` after every optimizer step, ``restore()`` on start-up.

``save`` blocks only for one copy of this role's unique bytes into a daemon slot that was
allocated and pre-faulted once and is reused; it then sends ``commit`` and returns. The daemon
checksums and records the slot while training goes on; its reply (which also hands out the
slot for the next save, so a save is one request) is read at the next ``save``, ``wait`` or
``settle`` — no thread of ours waits for it. At most one commit is in flight: a ``save`` that
finds the previous one unanswered waits for it (``on_busy="wait"``, the default) or returns
False without saving (``on_busy="skip"``); a commit that failed raises there, once.
``restore()`` returns the newest step every role of the job has committed intact (all roles
restore the same step), reassembling the razored replicated state from the dp group's shards;
``restore(into=state)`` copies into the caller's tensors.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from trainer_client._copy import copy_all
from trainer_client._daemon_client import DaemonClient
from trainer_client.dataloader import DEFAULT_SOCKET, SOCKET_ENV
from trainer_client.events import emit
from trainer_client.torchrun import check_restartable
from trainer_client.errors import CorruptError, FFPlaneError, FFTimeoutError, NotFoundError, TransportError
from trainer_client.pagemap import populate_read
from trainer_client.razor import Layout, slice_of
from trainer_client.state_codec import Encoded, decode, encode

log = logging.getLogger(__name__)
_MADV_POPULATE_WRITE = 23
_open: weakref.WeakSet[Checkpointer] = weakref.WeakSet()  # for settle_all (the DDP comm hook)


def settle_all() -> None:
    """Wait until every open Checkpointer's last save is committed and replicated. The DDP comm
    hook calls it before a step's first all-reduce: a node cannot finish step T's all-reduce
    (letting the other ranks commit T) until its own step T-1 has a replica on the next node,
    so losing it costs at most one step."""
    for ckpt in list(_open):
        ckpt.settle()


@dataclass
class Restored:
    step: int
    state: Any
    source: str  # "memory" or "durable"


@dataclass(frozen=True)
class _Grant:
    """A slot the daemon gave this role for one save: by ``begin``, or reserved in the previous
    commit's reply (``reserved``)."""

    slot: str  # relative to the daemon's root: how requests name it
    path: str  # absolute: where this process maps it
    reserved: bool


class _Slot:
    """One slot file mapped shared and writable, pre-faulted once, as a uint8 tensor."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        try:
            self.mm.madvise(_MADV_POPULATE_WRITE)  # page tables now, not on the first save's copy
        except OSError:
            pass
        self.path = path
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)

    def close(self) -> None:
        del self.tensor
        try:
            self.mm.close()
        except BufferError:
            pass  # a restored view still uses it; the mapping goes when that view does


class Checkpointer:
    def __init__(
        self,
        job: str,
        layout: Layout | None = None,
        *,
        private_keys: tuple[str, ...] = (),
        socket_path: str | os.PathLike[str] | None = None,
        durable_dir: str | os.PathLike[str] | None = None,
        on_busy: Literal["wait", "skip"] = "wait",
        timeout_s: float = 120.0,
        copy_threads: int | None = None,
    ) -> None:
        """``private_keys``: top-level state keys that are *not* replicated across the dp group
        (e.g. ``("optim",)`` with a ZeRO-sharded optimizer); everything else is razored.
        ``copy_threads``: threads for the blocking copy (default: cores, at most 4)."""
        if on_busy not in ("wait", "skip"):
            raise ValueError(f"on_busy must be 'wait' or 'skip', got {on_busy!r}")
        check_restartable()
        self.job = job
        self.layout = layout or Layout()
        self.private_keys = frozenset(private_keys)
        self.socket_path = Path(socket_path or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET)
        self.durable_dir = Path(durable_dir) if durable_dir else None
        self.on_busy = on_busy
        self.timeout_s = timeout_s
        self._commit_wait_s = 30.0  # the longest the daemon holds a commit answer for its replica (it says at alloc)
        self.copy_threads = max(1, copy_threads or min(4, os.cpu_count() or 1))
        self._copiers: ThreadPoolExecutor | None = None
        self._client: DaemonClient | None = None
        self._lock = threading.Lock()  # one request at a time on the daemon connection
        self._slots: dict[str, _Slot] = {}
        self._slot_size = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"ffplane-verify-{job}-{self.layout.role}")  # restore only
        self._pending: dict[str, Any] | None = None  # the commit sent (or not: _unsent), its reply not read yet
        self._unsent: TransportError | None = None  # why the pending commit could not be sent
        self._failed: FFPlaneError | None = None  # a commit that failed, for the next save or wait
        self._reserved: _Grant | None = None  # the slot the last commit reply handed out
        self._static: dict[str, Any] = {}  # the header's static part the daemon has (and its digest)
        self._static_digest = ""
        self._encoded: Encoded | None = None  # the last save's, whose storage views encode reuses
        # in every header; a Checkpointer's layout is fixed (Layout is frozen, and never reassigned)
        self._layout_fields = {"role": self.role, "layout": asdict(self.layout), "layout_roles": self.layout.all_roles()}
        self.last_save_block_s = 0.0
        self.saves = self.skipped = 0
        # Which run segment this state belongs to: 0 for a fresh job, then a hash of the restored
        # segment and step. Saves of a segment the job rewound from (a role that committed a step
        # the others never reached) carry another value, so a restore never mixes the two.
        self.lineage = 0
        _open.add(self)

    @property
    def role(self) -> str:
        return self.layout.role

    def _call(self, **msg: Any) -> dict[str, Any]:
        with self._lock:
            self._collect(block=True)  # its reply comes first on the connection
            return self._call_locked(msg)

    def _connected(self) -> DaemonClient:
        if self._client is None:
            self._client = DaemonClient(self.socket_path, self.timeout_s)
        return self._client

    def _call_locked(self, msg: dict[str, Any]) -> dict[str, Any]:
        for attempt in (0, 1):
            try:
                return self._connected().call(**msg)
            except FFTimeoutError:
                self._client = None  # closed by the client: a late reply must not be misread
                raise
            except TransportError:
                # the daemon restarted (it reattaches slots and versions): reconnect once.
                # A commit is repeated only into a reserved slot, which the new daemon can
                # adopt; a begun one it never knew of.
                self._disconnect()
                if attempt or (msg.get("op") == "commit" and not msg.get("reserved")):
                    raise
        raise AssertionError("unreachable")

    # --- save ----------------------------------------------------------------------------
    def save(self, step: int, state: Any) -> bool:
        """Checkpoint ``state`` as the state after optimizer step ``step``; False if skipped."""
        with self._lock:
            if not self._collect(block=self.on_busy == "wait"):
                self.skipped += 1
                return False
        self._raise_failed()
        started = time.perf_counter()
        enc = self._encoded = encode(state, self.private_keys, self._encoded)
        replicated = enc.stream_nbytes["replicated"]
        lo, hi = slice_of(replicated, self.layout.dp, self.layout.dp_rank)
        private = enc.stream_nbytes["private"]
        nbytes = private + hi - lo
        if nbytes > self._slot_size or not self._slots:
            self._allocate(nbytes)
        slot, self._reserved = self._reserved, None
        if slot is None or slot.path not in self._slots:
            slot = self._begin_slot(step, nbytes)
        try:
            self._copy_into(slot.path, enc, lo, hi, private)
        except BaseException:
            try:  # give the slot back, or every later save would find none free
                self._call(op="abort", job=self.job, role=self.role, slot=slot.slot)
            except FFPlaneError:
                pass
            raise
        self.last_save_block_s = time.perf_counter() - started
        static = enc.static_header() | self._layout_fields | {
            "private_nbytes": private,
            "piece": [lo, hi],
            "unique_nbytes": private + replicated,
            "lineage": self.lineage,
        }
        self._post_commit(step, slot, nbytes, enc.tree, static)
        self.saves += 1
        emit("saved", step=step)
        return True

    def _copy_into(self, path: str, enc: Any, lo: int, hi: int, private: int) -> None:
        dst = self._slots[path].tensor
        jobs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for entry, src in zip(enc.storages, enc.sources):
            if entry.stream == "private":
                jobs.append((dst[entry.offset : entry.offset + entry.nbytes], src))
                continue
            a, b = max(entry.offset, lo), min(entry.offset + entry.nbytes, hi)
            if a < b:  # the part of this storage inside this rank's slice
                part = src if b - a == entry.nbytes else src[a - entry.offset : b - entry.offset]
                jobs.append((dst[private + a - lo : private + b - lo], part))
        copy_all(jobs, self._copiers_pool(), self.copy_threads)

    def _copiers_pool(self) -> ThreadPoolExecutor | None:
        if self.copy_threads < 2:
            return None
        if self._copiers is None:
            self._copiers = ThreadPoolExecutor(self.copy_threads - 1, thread_name_prefix=f"ffplane-copy-{self.role}")
        return self._copiers

    def _begin_slot(self, step: int, nbytes: int) -> _Grant:
        """A slot for ``step`` when no commit reply reserved one (the first save, a busy slot)."""
        try:
            slot = self._begin(step)
        except FFPlaneError as exc:
            if getattr(exc, "status", None) != 412:
                raise
            self._allocate(nbytes)  # the daemon lost our slots (a new node, a wiped tmpfs)
            slot = self._begin(step)
        if slot["path"] not in self._slots:
            self._allocate(nbytes)
        return _Grant(slot["slot"], slot["path"], reserved=False)

    def _allocate(self, nbytes: int) -> None:
        if self._reserved is not None:  # a slot of the old size: give it back
            reserved, self._reserved = self._reserved, None
            try:
                self._call(op="abort", job=self.job, role=self.role, slot=reserved.slot)
            except FFPlaneError:
                pass  # the daemon forgot it anyway (restarted)
        reply = self._call(op="alloc", job=self.job, role=self.role, nbytes=nbytes)
        self._commit_wait_s = float(reply.get("commit_wait_s", self._commit_wait_s))
        for s in self._slots.values():
            s.close()
        self._slots = {p: _Slot(p) for p in reply["paths"]}
        self._slot_size = min(s.mm.size() for s in self._slots.values())

    def _begin(self, step: int) -> dict[str, str]:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return self._call(op="begin", job=self.job, role=self.role, step=step)
            except FFPlaneError as exc:  # 409: a durable copy still holds the free slot
                if getattr(exc, "status", None) != 409 or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def _post_commit(self, step: int, slot: _Grant, nbytes: int, tree: Any, static: dict[str, Any]) -> None:
        """Send the commit without waiting for it: the daemon checksums and records the slot
        while training goes on, and its reply is read at the next save (or ``wait``/``settle``).
        The header's static part (tensors, storages, layout) goes only when it changed."""
        msg: dict[str, Any] = {
            "op": "commit", "job": self.job, "role": self.role, "step": step, "slot": slot.slot, "nbytes": nbytes,
            "header": {"tree": tree}, "save_block_s": self.last_save_block_s, "reserved": slot.reserved,
        }
        with self._lock:
            if static != self._static:
                self._static = static
                self._static_digest = _digest(static)
                msg["static_header"] = static
            msg["static"] = self._static_digest
            self._pending = msg
            try:
                self._connected().post(**msg)
            except TransportError as exc:
                self._disconnect()
                self._unsent = exc  # handled (resent, if reserved) when collected

    def _collect(self, block: bool) -> bool:
        """Read the pending commit's reply (caller holds the lock); False if it has not arrived
        and ``block`` is False. A failure is kept for ``_raise_failed``; a daemon that died mid-
        commit is asked again (a reserved slot survives its restart) or the step is logged as
        not committed (the previous ones are, and survive in shared memory)."""
        msg, unsent = self._pending, self._unsent
        if msg is None:
            return True
        if unsent is None and not block and not (self._client is not None and self._client.replied()):
            return False
        if unsent is None and block and self._client is not None and not self._client.replied(_SAY_WHY_AFTER_S):
            log.warning(
                "save waits for the commit of step %d: the node daemon answers a commit once its ring successor holds the "
                "replica, for at most %.0f s (the daemon's --replica-wait-s); the daemon's /v1/state 'replication' says why it lags",
                msg["step"], self._commit_wait_s, extra={"job": self.job, "role": self.role, "step": msg["step"]},
            )
        self._pending = self._unsent = None
        reply: dict[str, Any] | None
        try:
            if unsent is not None:
                raise unsent
            assert self._client is not None
            try:
                reply = self._client.reply(msg)
            except FFTimeoutError:
                self._client = None  # closed by the client: a late reply must not be misread
                raise
        except TransportError as exc:
            self._disconnect()
            if not msg["reserved"]:
                log.warning("step %d not committed: %s", msg["step"], exc, extra={"job": self.job, "role": self.role, "step": msg["step"]})
                return True
            reply = self._recommit(msg, exc)
        except FFPlaneError as exc:
            if getattr(exc, "status", None) != 428:  # 428: the daemon lacks our static header
                self._commit_failed(msg, exc)
                return True
            reply = self._recommit(msg, exc)
        if reply is not None and reply.get("next"):  # the next save's slot: no 'begin' before it
            self._reserved = _Grant(reply["next"]["slot"], reply["next"]["path"], reserved=True)
        return True

    def _recommit(self, msg: dict[str, Any], why: FFPlaneError) -> dict[str, Any] | None:
        """Send a commit again, whole (a restarted daemon, or one missing the static header)."""
        msg = {**msg, "static_header": self._static}
        try:
            return self._call_locked(msg)
        except TransportError as exc:
            log.warning("step %d not committed: %s (then %s)", msg["step"], why, exc, extra={"job": self.job, "role": self.role, "step": msg["step"]})
        except FFPlaneError as exc:
            self._commit_failed(msg, exc)
        return None

    def _commit_failed(self, msg: dict[str, Any], exc: FFPlaneError) -> None:
        """A reserved slot the daemon neither handed out nor could adopt (409), or a role it has
        no slots for (412), means the daemon came back without our slots (a wiped tmpfs, a new
        node): the step is not committed and the next save allocates afresh. Anything else is
        the caller's to hear, at the next save or wait."""
        if msg["reserved"] and getattr(exc, "status", None) in (409, 412):
            log.warning("step %d not committed: %s; the daemon lost this role's slots, the next save allocates new ones", msg["step"], exc, extra={"job": self.job, "role": self.role, "step": msg["step"]})
            return
        self._failed = exc

    def _disconnect(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _raise_failed(self) -> None:
        failed, self._failed = self._failed, None
        if failed is not None:
            raise failed

    def wait(self) -> None:
        """Block until the last save is committed (raises, once, if its commit failed)."""
        with self._lock:
            self._collect(block=True)
        self._raise_failed()

    def settle(self) -> None:
        """Wait until the last save is committed and replicated (never raises: ``save`` and
        ``wait`` report a failed commit)."""
        with self._lock:
            self._collect(block=True)

    # --- restore -------------------------------------------------------------------------
    def restore(self, into: Any = None, view: bool = False, agree: bool = True) -> Restored | None:
        """The restorable step's state for this role, or None on a fresh job.

        * ``restore()``: fresh tensors, owned by the caller (one allocation per saved storage;
          tensors that shared a storage share it again).
        * ``restore(into=state)``: copied into the caller's existing tensors (same structure),
          no allocation but for storages the razor split across the dp group.
        * ``restore(view=True)``: zero-copy views of the shards where a storage lies in one shard.
          Read-only by contract and valid only until this role's second save after the restore:
          the slot they map is then reused (a write to them stays private, copy-on-write).

        The step is job-wide: the local daemon asks the coordinator for the newest step every
        role has somewhere alive and pulls this role's shards (and its dp peers' razored pieces)
        from other nodes if they are not local. With ``agree`` and an initialised
        ``torch.distributed`` group, the ranks also take the minimum of their answers (a collective:
        every rank must call ``restore``), so every role restores the same step.
        """
        emit("restoring")
        group = _group() if agree else None
        below: int | None = None
        retries = 0
        while True:
            # Every rank makes the same collective calls whatever happens locally: a rank that
            # fails says so through the reduction, and then every rank raises (no rank is left
            # waiting in an all_reduce the others never join).
            error: BaseException | None = None
            found = None
            try:
                found = self._restorable(below)
            except FFPlaneError as exc:
                error = exc
            mine = -1 if found is None else found[0]
            ok, low, high = _reduce_min(group, [0 if error else 1, mine, -mine])
            if not ok:
                raise error or FFPlaneError(f"another rank could not look up its checkpoint of job {self.job!r}; see its log")
            if -high < 0:  # no rank found anything
                if below is not None:  # there were versions, and every one failed its checksum
                    raise CorruptError(f"no intact checkpoint of job {self.job!r} below step {below} for every role; all copies failed their checksums")
                return None
            if low < 0:
                raise NotFoundError(
                    f"some ranks of job {self.job!r} found no checkpoint while others found step {-high}; refusing to start "
                    "fresh beside restored ranks (is every node's daemon running and reachable?)"
                )
            step = low  # the ranks' minimum; every rank loads exactly this step
            status, restored, source = _INTACT, None, ""
            try:
                if found is None or found[0] != step:
                    found = self._restorable(below, step=step)
                    if found is None or found[0] != step:
                        raise NotFoundError(f"the ranks agreed on step {step} but this daemon cannot provide it for role {self.role}")
                _, source, shards = found
                # the daemon checks the checksums of the in-memory shards we use while we copy them
                in_memory = [] if source == "durable" else sorted(r for r, sh in shards.items() if sh.get("kind") != "durable")
                intact = self._pool.submit(self._call, op="verify", job=self.job, step=step, roles=in_memory) if in_memory else None
                lineages = {int(sh["header"].get("lineage", 0)) for sh in shards.values()}
                lineage = min(lineages)
                restored = self._load(step, source, shards, into, view)
                if intact is not None and not intact.result(timeout=self.timeout_s)["intact"]:
                    status = _ANOTHER_COPY  # the daemon dropped the corrupt copy; the step may have others
                if len(lineages) > 1:
                    status = _OLDER
            except CorruptError as exc:  # no intact copy of some role at this step
                log.warning("%s", exc, extra={"job": self.job, "role": self.role})
                status, lineage = _OLDER, 0
            except FFPlaneError as exc:
                error, status, lineage = exc, _FAILED, 0
            agreed_status, low, high = _reduce_min(group, [status, lineage, -lineage])
            if agreed_status == _FAILED:
                raise error or FFPlaneError(f"another rank could not restore step {step} of job {self.job!r}; see its log")
            if agreed_status == _INTACT and low == -high and restored is not None:
                self.lineage = _next_lineage(low, step)
                emit("restored", step=step, source=source)
                return restored
            if agreed_status == _ANOTHER_COPY and retries < _MAX_COPIES_PER_STEP:
                retries += 1
                log.warning("a copy of step %d failed its checksum and was dropped; trying its other copies", step, extra={"job": self.job, "role": self.role})
                below = step + 1
                continue
            log.warning("step %d has no intact copy of some role, or mixes shards of a run the job rewound from; restoring an older step", step, extra={"job": self.job, "role": self.role})
            below, retries = step, 0

    def _load(self, step: int, source: str, shards: dict[str, Any], into: Any, view: bool) -> Restored:
        me = shards.get(self.role)
        if me is None:
            raise NotFoundError(f"step {step} has no shard for role {self.role}; roles present: {sorted(shards)}")
        header = me["header"]
        mine = _map_shard(me)
        peers = {r: _map_shard(shards[r]) for r in self.layout.dp_peers() if r in shards and r != self.role}
        pieces = [(shards[r]["header"]["piece"], shards[r]["header"]["private_nbytes"], peers.get(r, mine)) for r in self.layout.dp_peers() if r in shards]
        storages = []
        lo, hi = header["piece"]
        private = header["private_nbytes"]
        owned = into is None and not view  # the caller gets tensors that no slot reuse can touch
        for entry in header["storages"]:
            off, n = entry["offset"], entry["nbytes"]
            if entry["stream"] == "private":
                mapped = mine[off : off + n]
            elif lo <= off and off + n <= hi:
                mapped = mine[private + off - lo : private + off - lo + n]
            else:
                storages.append(_assemble(off, n, pieces, step))  # already a fresh buffer
                continue
            storages.append(mapped.clone() if owned else mapped)
        pool = self._copiers_pool()
        state = decode(header, storages, into, copy=lambda pairs: copy_all(pairs, pool, self.copy_threads))
        return Restored(step, state, source)

    def _restorable(self, below: int | None, step: int | None = None) -> tuple[int, str, dict[str, Any]] | None:
        try:
            reply = self._ask_restorable(below, step)
        except FFPlaneError as exc:
            if self.durable_dir is None or getattr(exc, "status", None) == 503:
                raise
            log.warning("no daemon answered (%s): restoring from the durable tier %s", exc, self.durable_dir)
            return self._durable()
        if reply.get("message"):
            log.warning("%s", reply["message"], extra={"job": self.job, "role": self.role})
        if reply["step"] is None:
            if reply.get("corrupt"):
                raise CorruptError(f"job {self.job!r}: {reply['message']}")
            found = self._durable() if self.durable_dir is not None else None  # our own copy, if any
            if found is None and reply.get("message") and below is None:
                # the job has state, just no consistent step of it: starting fresh would silently
                # throw the run away
                raise NotFoundError(f"job {self.job!r} cannot be restored: {reply['message']}; pass durable_dir= to use a durable copy")
            return found
        return int(reply["step"]), str(reply["source"]), dict(reply["shards"])

    def _ask_restorable(self, below: int | None, step: int | None) -> dict[str, Any]:
        roles = sorted({self.role, *self.layout.dp_peers()})
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return self._call(op="restorable", job=self.job, verify=False, below=below, roles=roles, step=step)
            except FFPlaneError as exc:
                # 503: a node holding a shard we need did not answer — it may be dying, and the
                # coordinator declares it dead within two seconds; then another copy is chosen
                if getattr(exc, "status", None) != 503 or time.monotonic() > deadline:
                    raise
                log.warning("%s", exc, extra={"job": self.job, "role": self.role})
                time.sleep(0.5)

    def _durable(self) -> tuple[int, str, dict[str, Any]] | None:
        from statestore import durable

        assert self.durable_dir is not None
        step, shards = durable.restorable(self.durable_dir, self.job, set(self.layout.all_roles()))
        return None if step is None else (step, "durable", shards)

    def close(self) -> None:
        """Wait for the last commit, stop the commit thread, unmap slots; safe to call twice."""
        _open.discard(self)
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            if self._copiers is not None:
                self._copiers.shutdown(wait=True)
                self._copiers = None
            for s in self._slots.values():
                s.close()
            self._slots = {}
            with self._lock:
                self._disconnect()


_SAY_WHY_AFTER_S = 1.0  # a save waiting this long for the previous commit logs why
# A rank's outcome of loading the agreed step; the ranks act on the minimum.
_FAILED, _OLDER, _ANOTHER_COPY, _INTACT = -1, 0, 1, 2
_MAX_COPIES_PER_STEP = 8  # each try drops a corrupt copy, so this only bounds a misbehaving daemon


def _digest(static: dict[str, Any]) -> str:
    import xxhash

    return xxhash.xxh3_64_hexdigest(json.dumps(static, sort_keys=True).encode())


def _group() -> Any:
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _next_lineage(lineage: int, step: int) -> int:
    import xxhash

    return xxhash.xxh3_64_intdigest(f"{lineage}:{step}".encode()) & ((1 << 62) - 1)  # fits an int64 all_reduce


def _reduce_min(group: Any, values: list[int]) -> list[int]:
    """Element-wise minimum over the ranks (the values themselves without a process group)."""
    if group is None:
        return values
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.int64)
    if dist.get_backend(group) == "nccl":  # NCCL reduces device tensors only
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [int(v) for v in t.tolist()]


def _map_shard(shard: dict[str, Any]) -> torch.Tensor:
    """A shard's bytes as a uint8 tensor over a private (copy-on-write) mapping of its file."""
    fd = os.open(shard["path"], os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    populate_read(whole.data_ptr(), size)
    begin = int(shard["offset"])
    if begin + int(shard["nbytes"]) > size:
        raise CorruptError(f"shard {shard['path']} is shorter than its header says")
    return whole[begin : begin + int(shard["nbytes"])]


def _assemble(off: int, n: int, pieces: list[tuple[list[int], int, torch.Tensor]], step: int) -> torch.Tensor:
    """A razored storage rebuilt from the dp group's slices of the replicated stream."""
    out = torch.empty(n, dtype=torch.uint8)
    covered = 0
    for (lo, hi), private, shard in pieces:
        a, b = max(off, lo), min(off + n, hi)
        if a < b:
            out[a - off : b - off].copy_(shard[private + a - lo : private + b - lo])
            covered += b - a
    if covered != n:
        raise CorruptError(
            f"step {step}: the dp group's slices {[p[0] for p in pieces]} cover {covered} of the {n} bytes at "
            f"{off} of the replicated stream; a peer's shard is missing or was saved with another layout"
        )
    return out
