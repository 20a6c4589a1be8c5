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

CUDA state is copied device → slot directly, on a side stream per device, into the slot's pages
registered as pinned memory once (``trainer_client.pinned``): no intermediate host buffer, no
allocation per save. With ``overlap_with=optimizer`` the copy runs during the next forward and
backward instead: ``save`` returns once the copies are queued, the commit is handed to the daemon
when they complete, and the optimizer's ``step`` waits for them (a step pre-hook) — the weights
cannot change before then. On CPU the same mode copies on a thread.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import torch

from ffplane_contract import files
from ffplane_contract.limits import check_step
from trainer_client._collector import paused as collector_paused
from trainer_client._commit import CommitPipeline, KeptCopies, _Slot
from trainer_client._copy import copy_all
from trainer_client._device_copy import CopyInFlight, copy_now, start_copies
from trainer_client._restore import RestoreAgreement, Restored
from trainer_client.events import emit
from trainer_client.launch import check_restartable
from trainer_client.razor import Layout, slice_of
from trainer_client.replicated_check import check_replicated
from trainer_client.state_codec import Encoded, encode

__all__ = ["Checkpointer", "Restored", "settle_all"]

log = logging.getLogger(__name__)
_open: weakref.WeakSet[Checkpointer] = weakref.WeakSet()  # for settle_all (the DDP comm hook)


def settle_all() -> None:
    """Wait until every open Checkpointer's last save is committed and replicated. Call it on
    every rank before a step's first collective (the DDP comm hook does, before the all-reduce;
    an FSDP2 loop before ``backward``): a node cannot finish step T's collective (letting the
    other ranks save T) until its own last save has a replica on the next node, so losing it
    costs at most one step. The next save then says it is *settled*: no role can need a version
    older than its newest any more, and the daemons keep two copies of each role's shard where
    they would keep three (``statestore.retention``). A last save that was not committed (its
    daemon went away and did not come back in time, or the commit failed) raises here instead."""
    for ckpt in list(_open):
        ckpt.settle()
        ckpt._commits.raise_lost()  # an answer that is a failure proves nothing: raised before the collective
        ckpt._settled = True


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
        overlap_with: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
    ) -> None:
        """``private_keys``: top-level state keys that are *not* replicated across the dp group
        (e.g. ``("optim",)`` with a ZeRO-sharded optimizer); everything else is razored.
        ``copy_threads``: threads for the blocking copy (default: cores, at most 4).
        ``overlap_with``: the optimizer(s) whose ``step`` is the next write to the saved state;
        a save's copy then overlaps the next forward/backward and their ``step`` waits for it.
        Anything else that writes saved tensors in place before that step (a GradScaler whose
        step was skipped updates its scale) must call ``finish_copy()`` first."""
        if on_busy not in ("wait", "skip"):
            raise ValueError(f"on_busy must be 'wait' or 'skip', got {on_busy!r}")
        check_restartable()
        self.job = job
        self.layout = layout or Layout()
        self.private_keys = frozenset(private_keys)
        self.socket_path = files.socket_path(socket_path)
        self.durable_dir = Path(durable_dir) if durable_dir else None
        self.on_busy = on_busy
        self.timeout_s = timeout_s
        self.copy_threads = max(1, copy_threads or min(4, os.cpu_count() or 1))
        self._copiers: ThreadPoolExecutor | None = None
        self._commits = CommitPipeline(job, self.role, self.socket_path, timeout_s)
        self._restore = RestoreAgreement(self._commits, job, self.layout, self.durable_dir, timeout_s, self._copy_any)
        self._encoded: Encoded | None = None  # the last save's, whose storage views encode reuses
        # in every header; a Checkpointer's layout is fixed (Layout is frozen, and never reassigned)
        self._layout_fields = {"role": self.role, "layout": asdict(self.layout), "layout_roles": self.layout.all_roles()}
        self.last_save_block_s = 0.0
        self.saves = self.skipped = 0
        self._settled = False  # settle_all() ran since the last save (see there)
        self._alone = self.layout.dp * self.layout.pp * self.layout.tp == 1
        # Which run segment this state belongs to: 0 for a fresh job, then a hash of the restored
        # segment and step. Saves of a segment the job rewound from (a role that committed a step
        # the others never reached) carry another value, so a restore never mixes the two.
        self.lineage = 0
        optimizers = [overlap_with] if isinstance(overlap_with, torch.optim.Optimizer) else list(overlap_with or [])
        if not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            raise TypeError(f"overlap_with takes torch.optim.Optimizer objects, got {[type(o).__name__ for o in optimizers]}")
        self.overlapped = bool(optimizers)
        self._hooks = [o.register_step_pre_hook(self._before_optimizer_step) for o in optimizers]
        self._background: ThreadPoolExecutor | None = None  # the overlapped host copy, then the commit
        self._in_flight: Future[None] | None = None  # an overlapped save not yet handed to the daemon
        self.last_overlap_wait_s = 0.0  # how long the last optimizer step waited for an overlapped copy
        _open.add(self)

    @property
    def role(self) -> str:
        return self.layout.role

    # --- save ----------------------------------------------------------------------------
    def save(self, step: int, state: Any, *, header: dict[str, Any] | None = None) -> bool:
        """Checkpoint ``state`` as the state after optimizer step ``step``; False if skipped.
        ``step`` is in 0..2^53-1 (the range every ffplane process shares); ValueError otherwise.
        ``header``: JSON fields an adapter keeps beside the shard (``DaemonWriter`` keeps DCP's
        catalogue there), sent to the daemon only when they change; a field ffplane writes
        itself (role, layout, piece ...) is refused."""
        try:
            check_step(step)
        except ValueError as exc:
            raise ValueError(f"Checkpointer.save: {exc}") from None
        if self._in_flight is not None and not self._in_flight.done() and self.on_busy == "skip":
            self.skipped += 1
            return False
        self.finish_copy()
        if not self._commits.ready(block=self.on_busy == "wait"):
            self.skipped += 1
            return False
        self._commits.raise_failed()
        # one role alone has no other to wait for: its previous save is answered (just above)
        settled, self._settled = self._settled or self._alone, False
        if self.saves == 0 and self.layout.dp > 1 and _replicated_keys(state, self.private_keys):
            # per-rank state saved as replicated would come back as another rank's
            check_replicated(state, self.private_keys, self.layout, _group())
        started = time.perf_counter()
        # what a save builds per tensor is not garbage (trainer_client._collector); the waits —
        # for the previous commit above, for a device copy and this commit's post below — stay outside
        with collector_paused():
            enc = self._encoded = encode(state, self.private_keys, self._encoded, step, self.layout)
            replicated = enc.stream_nbytes["replicated"]
            lo, hi = slice_of(replicated, self.layout.dp, self.layout.dp_rank)
            private = enc.stream_nbytes["private"]
            nbytes = private + hi - lo
            static = (
                enc.static_header()
                | self._layout_fields
                | {
                    "private_nbytes": private,
                    "piece": [lo, hi],
                    "unique_nbytes": private + replicated,
                    "lineage": self.lineage,
                }
            )
            if header:
                if clash := sorted(header.keys() & static.keys()):
                    raise ValueError(f"Checkpointer.save: header fields {clash} are ffplane's own")
                static |= header
            slot, reserved, mapped = self._commits.take_slot(step, nbytes, settled)
            try:
                copies = self._pairs(mapped, enc, lo, hi, private)
                if copies.on_device:
                    self._commits.pin(slot)  # once per slot: device → slot copies run asynchronously
                flight = start_copies(copies.pairs, self._copy, self._background_pool() if self.overlapped else None)
            except BaseException:
                self._commits.abort(slot)
                raise

        def commit(flight: CopyInFlight) -> None:
            """Once the bytes are in the slot: the commit goes to the daemon (or the slot back)."""
            try:
                flight.wait()
            except BaseException:
                self._commits.abort(slot)
                raise
            if not self.overlapped:
                self.last_save_block_s = time.perf_counter() - started
            self._commits.post(step, slot, reserved, nbytes, enc.tree_json(), static, self.last_save_block_s, settled)

        if self.overlapped:
            self.last_save_block_s = time.perf_counter() - started  # the copies queued, not done
            # on the host copy's thread, after it: the commit follows the last byte
            self._in_flight = self._background_pool().submit(commit, flight)
        else:
            commit(flight)
        self.saves += 1
        emit("saved", step=step)
        return True

    def finish_copy(self) -> None:
        """Wait until an overlapped save's bytes are in its slot and its commit handed to the
        daemon (re-raising what went wrong); a no-op when none is in flight. The optimizers
        given as ``overlap_with`` call it before their step."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            started = time.perf_counter()
            in_flight.result()
            self.last_overlap_wait_s = time.perf_counter() - started

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.finish_copy()

    def _background_pool(self) -> ThreadPoolExecutor:
        if self._background is None:
            self._background = ThreadPoolExecutor(1, thread_name_prefix=f"ffplane-overlap-{self.role}")
        return self._background

    def _pairs(self, mapped: _Slot, enc: Encoded, lo: int, hi: int, private: int) -> KeptCopies:
        """(slot part, source) for every storage byte range this role saves: the last save into
        this slot's list while ``enc`` is of its generation (``encode`` keeps the number while the
        storages, their places and their views are the previous save's objects), else made afresh
        — a view per storage, several per tensor of a large model's state, every step otherwise."""
        kept = mapped.copies
        if kept is not None and kept.generation == enc.generation and kept.bounds == (lo, hi, private):
            return kept
        self._commits.forget_copies(enc.generation)  # the others' lists view storages this save no longer has
        dst = mapped.tensor
        jobs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for entry, src in zip(enc.storages, enc.sources):
            if entry.stream == "private":
                jobs.append((dst[entry.offset : entry.offset + entry.nbytes], src))
                continue
            a, b = max(entry.offset, lo), min(entry.offset + entry.nbytes, hi)
            if a < b:  # the part of this storage inside this rank's slice
                part = src if b - a == entry.nbytes else src[a - entry.offset : b - entry.offset]
                jobs.append((dst[private + a - lo : private + b - lo], part))
        mapped.copies = KeptCopies(enc.generation, (lo, hi, private), jobs, any(s.is_cuda for _, s in jobs))
        return mapped.copies

    def _copy(self, jobs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        copy_all(jobs, self._copiers_pool(), self.copy_threads)

    def _copy_any(self, jobs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Host and device pairs (a restore into CUDA tensors), done when it returns."""
        copy_now(jobs, self._copy)

    def _copiers_pool(self) -> ThreadPoolExecutor | None:
        if self.copy_threads < 2:
            return None
        if self._copiers is None:
            self._copiers = ThreadPoolExecutor(self.copy_threads - 1, thread_name_prefix=f"ffplane-copy-{self.role}")
        return self._copiers

    def wait(self) -> None:
        """Block until the last save is committed (raises, once, if its commit failed)."""
        self.finish_copy()
        self._commits.ready(block=True)
        self._commits.raise_failed()

    def settle(self) -> None:
        """Wait until the last save is committed and replicated (never raises: ``save`` and
        ``wait`` report a failed commit)."""
        if self._in_flight is not None:
            futures_wait([self._in_flight])  # a failure stays for the next save or wait to raise
        self._commits.ready(block=True)

    # --- restore -------------------------------------------------------------------------
    def restore(self, into: Any = None, view: bool = False, agree: bool = True, mesh: Any = None) -> Restored | None:
        """The restorable step's state for this role, or None on a fresh job.

        * ``restore()``: fresh tensors, owned by the caller (one allocation per saved storage;
          tensors that shared a storage share it again).
        * ``restore(into=state)``: copied into the caller's existing tensors (same structure),
          no allocation but for storages the razor split across the dp group.
        * ``restore(mesh=device_mesh)``: saved DTensors (FSDP2, tensor parallel) come back as
          DTensors on ``mesh`` with their saved placements (``into`` DTensors need no mesh).
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
        self.finish_copy()
        restored, lineage = self._restore.run(into, view, _group() if agree else None, mesh)
        if restored is not None:
            self.lineage = next_lineage(lineage, restored.step)
            emit("restored", step=restored.step, source=restored.source)
        return restored

    def close(self) -> None:
        """Wait for the last commit, unmap slots, end the threads; safe to call twice."""
        _open.discard(self)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        try:
            self.wait()
        finally:
            if self._background is not None:
                self._background.shutdown(wait=True)
                self._background = None
            self._restore.close()
            if self._copiers is not None:
                self._copiers.shutdown(wait=True)
                self._copiers = None
            self._commits.close()


def _replicated_keys(state: Any, private_keys: frozenset[str]) -> bool:
    return not isinstance(state, dict) or any(str(k) not in private_keys for k in state)


def _group() -> Any:
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def next_lineage(lineage: int, step: int) -> int:
    import xxhash

    return xxhash.xxh3_64_intdigest(f"{lineage}:{step}".encode()) & ((1 << 62) - 1)  # fits an int64 all_reduce
