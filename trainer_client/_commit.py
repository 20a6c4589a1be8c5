"""The save side of a Checkpointer: the daemon connection, the role's mapped slots, and the
commit state machine.

A save copies into a slot, then sends ``Commit`` without waiting; the reply (which hands out the
slot for the next save, so a steady-state save is one request) is read at the next save, ``wait``
or ``settle``: no thread of ours waits for it. At most one commit is in flight. The states: a
commit sent and unanswered (``_pending``), one that could not be sent (``_unsent``), one that
failed and is the caller's to hear once (``_failed``), the reserved slot (``_reserved``), and
the header's static part the daemon holds (``_static``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import mmap
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ffplane_contract import control as proto
from ffplane_contract.errors import (
    FFPlaneError,
    FFTimeoutError,
    NoSlotsError,
    SlotBusyError,
    StaticHeaderUnknownError,
    TransportError,
    UnavailableError,
    UnknownSlotError,
)
from ffplane_runtime.pagemap import populate_write
from trainer_client._daemon_client import DaemonClient
from trainer_client.pinned import Registration

log = logging.getLogger(__name__)
_SAY_WHY_AFTER_S = 1.0  # a save waiting this long for the previous commit logs why
# How long a commit into a reserved slot is asked again while its daemon is restarting: answered
# "not committed" at once, the rank would let the job's next collective pass (settle_all) with a
# step it does not have, and the other ranks' settled saves drop the version it still needs.
_DAEMON_BACK_S = 30.0


@dataclasses.dataclass(frozen=True)
class KeptCopies:
    """A save's copy list into one slot, kept for the next save into it (``Checkpointer._pairs``)."""

    generation: int  # the Encoded.generation it was made for
    bounds: tuple[int, int, int]  # the role's slice [lo, hi) of the replicated stream, its private bytes
    pairs: list[tuple[torch.Tensor, torch.Tensor]]  # (slot part, source)
    on_device: bool  # some source is on a CUDA device


class _Slot:
    """One slot file mapped shared and writable, pre-faulted once, as a uint8 tensor."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            st = os.fstat(fd)
            size, self.file = st.st_size, (st.st_dev, st.st_ino)
            self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        populate_write(self.mm)  # page tables now, not on the first save's copy
        self.path = path
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.pinned: Registration | None = None  # registered for CUDA copies on the first one
        self.copies: KeptCopies | None = None  # the last save's into this slot; views this mapping, goes with it

    def same_file(self) -> bool:
        """Whether ``path`` is still the file mapped (a daemon that came back empty makes new
        files of the same names: bytes copied into the old mapping would reach none of them)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.file

    def pin(self) -> None:
        if self.pinned is None:
            self.pinned = Registration(self.tensor)

    def close(self) -> None:
        self.copies = None
        if self.pinned is not None:
            self.pinned.release()  # before the unmap; every copy into it has completed
            self.pinned = None
        del self.tensor
        try:
            self.mm.close()
        except BufferError:
            pass  # a restored view still uses it; the mapping goes when that view does


class CommitPipeline:
    def __init__(self, job: str, role: str, socket_path: Path, timeout_s: float) -> None:
        self.job, self.role = job, role
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.commit_wait_s = 30.0  # the longest the daemon holds a commit answer for its replica (it says at alloc)
        self._client: DaemonClient | None = None
        self._lock = threading.Lock()  # one request at a time on the daemon connection
        self._slots: dict[str, _Slot] = {}
        self._slot_size = 0
        self._pending: proto.Commit | None = None  # the commit sent (or not: _unsent), its reply not read yet
        self._unsent: TransportError | None = None  # why the pending commit could not be sent
        self._failed: FFPlaneError | None = None  # a commit that failed, for the next save or wait
        self.lost: int | None = None  # the step of the last save, if it was not committed (``settle_all`` raises)
        self._reserved: proto.Grant | None = None  # the slot the last commit reply handed out
        self._static: dict[str, Any] = {}  # the header's static part the daemon has (and its digest)
        self._static_digest = ""

    # --- requests ------------------------------------------------------------------------
    def call(self, req: proto.Request) -> Any:
        with self._lock:
            self._collect(block=True)  # its reply comes first on the connection
            return self._call_locked(req)

    def _connected(self) -> DaemonClient:
        if self._client is None:
            self._client = DaemonClient(self.socket_path, self.timeout_s)
        return self._client

    def _call_locked(self, req: proto.Request) -> Any:
        for attempt in (0, 1):
            try:
                return self._connected().call(req)
            except FFTimeoutError:
                self._client = None  # closed by the client: a late reply must not be misread
                raise
            except TransportError:
                # the daemon restarted (it reattaches slots and versions): reconnect once.
                # A commit is repeated only into a reserved slot, which the new daemon can
                # adopt; a begun one it never knew of.
                self._disconnect()
                if attempt or (isinstance(req, proto.Commit) and not req.reserved):
                    raise
        raise AssertionError("unreachable")

    def _disconnect(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # --- slots ---------------------------------------------------------------------------
    def ready(self, block: bool) -> bool:
        """Whether a save may start: the previous commit's reply read (waiting for it if ``block``)."""
        with self._lock:
            return self._collect(block)

    def take_slot(self, step: int, nbytes: int, settled: bool) -> tuple[proto.Grant, bool, _Slot]:
        """A slot of at least ``nbytes`` for ``step``, whether the last commit reply reserved it
        (else ``Begin`` granted it now), and its mapping. ``settled``: as ``Commit.settled``; a
        reserved slot that holds an older version is taken only by a settled save."""
        if nbytes > self._slot_size or not self._slots:
            self._allocate(nbytes)
        slot, self._reserved = self._reserved, None
        reserved = slot is not None and slot.path in self._slots and (settled or not slot.settled_only)
        if slot is None or not reserved:
            slot = self._begin_slot(step, nbytes, settled)  # the daemon takes back the reservation
        return slot, reserved, self._slots[slot.path]

    def forget_copies(self, generation: int) -> None:
        """Drop the kept copy lists made for another ``Encoded.generation``: they view an earlier
        save's storages, which must not outlive it (a state of new tensors every step would keep
        four of them alive)."""
        for mapped in self._slots.values():
            if mapped.copies is not None and mapped.copies.generation != generation:
                mapped.copies = None

    def pin(self, slot: proto.Grant) -> None:
        """Page-lock ``slot``'s mapping for CUDA copies (once per slot; no-op without CUDA)."""
        self._slots[slot.path].pin()

    def abort(self, slot: proto.Grant) -> None:
        """Give the slot back, or every later save would find none free."""
        try:
            self.call(proto.Abort(self.job, self.role, slot.slot))
        except FFPlaneError:
            pass  # the daemon forgot it anyway (restarted)

    def _begin_slot(self, step: int, nbytes: int, settled: bool) -> proto.Grant:
        """A slot for ``step`` when no commit reply reserved one (the first save, a busy slot)."""
        try:
            grant = self._begin(step, settled)
        except NoSlotsError:
            self._allocate(nbytes)  # the daemon lost our slots (a new node, a wiped tmpfs)
            grant = self._begin(step, settled)
        if grant.path not in self._slots:  # a slot more (an unsettled save), or new slots
            self._allocate(nbytes)
        return grant

    def _allocate(self, nbytes: int) -> None:
        if self._reserved is not None:  # a slot of the old size: give it back
            reserved, self._reserved = self._reserved, None
            self.abort(reserved)
        reply: proto.AllocReply = self.call(proto.Alloc(self.job, self.role, nbytes))
        self.commit_wait_s = reply.commit_wait_s
        # a slot more: the others stay mapped (if they are still the files of those names)
        kept = {p: self._slots.pop(p) for p in reply.paths if p in self._slots and self._slots[p].same_file()}
        for s in self._slots.values():
            s.close()
        self._slots = {p: kept.get(p) or _Slot(p) for p in reply.paths}
        self._slot_size = min(s.mm.size() for s in self._slots.values())

    def _begin(self, step: int, settled: bool) -> proto.Grant:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                grant: proto.Grant = self.call(proto.Begin(self.job, self.role, step, settled))
                return grant
            except SlotBusyError:  # a durable copy still holds the free slot
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    # --- commits -------------------------------------------------------------------------
    def post(
        self,
        step: int,
        slot: proto.Grant,
        reserved: bool,
        nbytes: int,
        tree_json: str,
        static: dict[str, Any],
        save_block_s: float,
        settled: bool = False,
    ) -> None:
        """Send the commit without waiting for it: the daemon checksums and records the slot
        while training goes on. The header's static part (tensors, storages, layout) goes only
        when it changed; the per-step part is the tree, as JSON text."""
        with self._lock:
            sent_static = None
            if static != self._static:
                self._static = static
                self._static_digest = _digest(static)
                sent_static = static
            msg = proto.Commit(
                self.job,
                self.role,
                step,
                slot.slot,
                nbytes,
                {"tree_json": tree_json},
                save_block_s,
                reserved,
                self._static_digest,
                sent_static,
                settled,
            )
            self._pending = msg
            try:
                self._connected().post(msg)
            except TransportError as exc:
                self._disconnect()
                self._unsent = exc  # handled (resent, if reserved) when collected

    def _collect(self, block: bool) -> bool:
        """Read the pending commit's reply (caller holds the lock); False if it has not arrived
        and ``block`` is False. A failure is kept for ``raise_failed``; a daemon that died mid-
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
                msg.step,
                self.commit_wait_s,
                extra={"job": self.job, "role": self.role, "step": msg.step},
            )
        self._pending = self._unsent = None
        self.lost = msg.step  # until a reply says it is committed
        reply: proto.CommitReply | None
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
            if not msg.reserved:
                log.warning("step %d not committed: %s", msg.step, exc, extra={"job": self.job, "role": self.role, "step": msg.step})
                return True
            reply = self._recommit(msg, exc)
        except StaticHeaderUnknownError as exc:
            reply = self._recommit(msg, exc)
        except FFPlaneError as exc:
            self._commit_failed(msg, exc)
            return True
        if reply is not None:
            self.lost = None
        if reply is not None and reply.next is not None:  # the next save's slot: no 'begin' before it
            self._reserved = reply.next
        return True

    def _recommit(self, msg: proto.Commit, why: FFPlaneError) -> proto.CommitReply | None:
        """Send a commit again, whole (a restarted daemon, or one missing the static header)."""
        msg = dataclasses.replace(msg, static_header=self._static)
        deadline = time.monotonic() + _DAEMON_BACK_S
        while True:
            try:
                reply: proto.CommitReply = self._call_locked(msg)
                return reply
            except TransportError as exc:
                if time.monotonic() < deadline and msg.reserved:  # the daemon may be restarting: its slots outlive it
                    time.sleep(0.05)
                    continue
                log.warning(
                    "step %d not committed: %s (then %s)", msg.step, why, exc, extra={"job": self.job, "role": self.role, "step": msg.step}
                )
            except FFPlaneError as exc:
                self._commit_failed(msg, exc)
            return None

    def _commit_failed(self, msg: proto.Commit, exc: FFPlaneError) -> None:
        """A reserved slot the daemon neither handed out nor could adopt, or a role it has no
        slots for, means the daemon came back without our slots (a wiped tmpfs, a new node):
        the step is not committed and the next save allocates afresh. Anything else is the
        caller's to hear, at the next save or wait."""
        if msg.reserved and isinstance(exc, (UnknownSlotError, NoSlotsError)):
            log.warning(
                "step %d not committed: %s; the daemon lost this role's slots, the next save allocates new ones",
                msg.step,
                exc,
                extra={"job": self.job, "role": self.role, "step": msg.step},
            )
            return
        self._failed = exc

    def raise_failed(self) -> None:
        failed, self._failed = self._failed, None
        if failed is not None:
            raise failed

    def raise_lost(self) -> None:
        """Raise (once) if the last save was not committed: a rank must not pass the job's next
        collective as if it were (``settle_all``)."""
        lost, self.lost = self.lost, None
        if lost is not None:
            failed, self._failed = self._failed, None
            raise failed or UnavailableError(
                f"step {lost} of {self.role} (job {self.job!r}) was not committed (its node daemon went away): the other "
                "ranks' next saves would drop the version this rank still needs, so the job restarts from the restorable step"
            )

    def close(self) -> None:
        for s in self._slots.values():
            s.close()
        self._slots = {}
        with self._lock:
            self._disconnect()


def _digest(static: dict[str, Any]) -> str:
    import xxhash

    return xxhash.xxh3_64_hexdigest(json.dumps(static, sort_keys=True).encode())
