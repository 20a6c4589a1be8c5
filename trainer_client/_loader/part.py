"""The protocol every part of the DataLoader follows, and the step that flows between them.

A part yields items in step order: ``next()``, ``StopIteration`` at the end. ``state_dict()`` is
where it is, and ``reset(state)`` continues exactly there: after ``b.reset(a.state_dict())``,
``b.next()`` returns what ``a.next()`` would have. Every state holds ``next_step`` (the step of
the next item); a part over another (a ``Stage``) adds keys of its own and hands the rest to the
part it reads, so one ``{"next_step": s}`` positions a whole chain at step ``s``.

The order of calls: ``reset`` (optional: before the first ``next`` or between two), ``next`` as
often as wanted, ``state_dict`` between any two calls, ``close`` last (safe twice).

Two hooks let ``LookAhead`` read a step on the calling thread when handing it to its own thread
would cost more than the read: ``cheap_next()`` (the next item needs no system call) and
``in_hand()`` (the memory the part reads from now: dropping another may unmap it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import pyarrow as pa

from trainer_client._device_copy import StagedBatch
from trainer_client.batches import StepBytes

T = TypeVar("T")
State = dict[str, Any]


class Part(ABC, Generic[T]):
    @abstractmethod
    def next(self) -> T:
        """The next item; ``StopIteration`` after the last."""

    @abstractmethod
    def state_dict(self) -> State:
        """Where the part is: ``reset`` with it continues at the item ``next`` would return now."""

    @abstractmethod
    def reset(self, state: State) -> None:
        """Continue where ``state`` (a ``state_dict()`` of a part like this one) says."""

    def close(self) -> None:
        """Let go of threads, connections and memory; safe to call twice."""

    def cheap_next(self) -> bool:
        """Whether ``next`` now costs no system call (it reads memory in hand)."""
        return False

    def in_hand(self) -> object | None:
        """The memory the part reads from now, if any."""
        return None


class Stage(Part[T]):
    """A part over another (``upstream``): its state, reset, close and hooks are the upstream's
    unless it says otherwise."""

    def __init__(self, upstream: Part[Any]) -> None:
        self.upstream = upstream

    def state_dict(self) -> State:
        return self.upstream.state_dict()

    def reset(self, state: State) -> None:
        self.upstream.reset(state)

    def close(self) -> None:
        self.upstream.close()

    def cheap_next(self) -> bool:
        return self.upstream.cheap_next()

    def in_hand(self) -> object | None:
        return self.upstream.in_hand()


@dataclass(eq=False)
class Fetched:
    """One step's batch as a source read it (the memory holding it, its record batch and
    metadata) and, once ``Placement`` staged it, its copy in page-locked memory or on a device."""

    step: int
    memory: StepBytes
    batch: pa.RecordBatch
    meta: dict[str, str]
    staged: StagedBatch | None = None

    @property
    def generation(self) -> int:
        """The generation the data server planned the step in (its start step; -1: untagged)."""
        return int(self.meta.get("generation", -1))

    def tensors(self) -> dict[str, Any]:
        """On the training thread: the batch as torch tensors (its copies completed, if staged),
        viewing the step's memory where the columns allow."""
        return self.staged.take() if self.staged is not None else self.memory.to_torch(self.batch)

    def release(self) -> None:
        """Before the memory may go: wait for the copies that read it."""
        if self.staged is not None:
            self.staged.release()
