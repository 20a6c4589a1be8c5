"""Gradient accumulation: each step's batch as ``k`` consecutive micro-batches."""

from __future__ import annotations

from typing import Any

from trainer_client._loader.part import Part, Stage, State

KEY = "micro_batch"  # the state's own key: the part of step ``next_step`` that comes next


def split(batch: Any, k: int) -> list[Any]:
    """``batch``'s rows in ``k`` consecutive parts (views; sizes differ by at most one row)."""
    if k == 1:
        return [batch]
    if not isinstance(batch, dict):
        raise TypeError(f"micro_batches={k} splits a batch of columns; got a {type(batch).__name__}")
    rows = {len(v) for v in batch.values()}
    if len(rows) != 1:
        raise ValueError(f"the batch's columns have different lengths {sorted(rows)}; cannot split it into micro-batches")
    n = rows.pop()
    if n < k:
        raise ValueError(f"a step of {n} rows cannot be split into micro_batches={k}")
    bounds = [n * i // k for i in range(k + 1)]
    return [{name: col[bounds[i] : bounds[i + 1]] for name, col in batch.items()} for i in range(k)]


class MicroBatches(Stage[Any]):
    """Each of the upstream's batches as ``k`` micro-batches, so a step stays an optimizer step
    (the job's ``max_steps`` counts optimizer steps). The state adds ``micro_batch``: saved in
    the middle of step s, it is ``{"next_step": s, "micro_batch": i}`` and a reset reads step s
    again and goes on at its part i."""

    def __init__(self, upstream: Part[Any], k: int) -> None:
        if k < 1:
            raise ValueError(f"micro_batches must be >= 1, got {k=}")
        super().__init__(upstream)
        self.k = k
        self._parts: list[Any] = []  # the parts of the step being split
        self._at = 0  # the next of them
        self._step_state: State = {}  # the upstream's position of that step
        self._skip = 0  # parts of the next step already had (after a reset)

    def next(self) -> Any:
        if self._at == len(self._parts):
            self._step_state = self.upstream.state_dict() if self.k > 1 else {}
            self._parts, self._at = split(self.upstream.next(), self.k), self._skip
            self._skip = 0
        part = self._parts[self._at]
        self._at += 1
        return part

    def state_dict(self) -> State:
        if self._at < len(self._parts):
            return {**self._step_state, KEY: self._at}
        return {**self.upstream.state_dict(), KEY: self._skip}

    def reset(self, state: State) -> None:
        skip = int(state.get(KEY, 0))
        if not 0 <= skip < self.k:
            raise ValueError(f"{KEY}={skip} is not a part of a step split in micro_batches={self.k}")
        self._parts, self._at, self._skip = [], 0, skip
        self.upstream.reset({key: value for key, value in state.items() if key != KEY})
