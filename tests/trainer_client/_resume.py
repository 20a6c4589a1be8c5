"""The one resume test every part of the DataLoader passes (``trainer_client._loader.part.Part``)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from trainer_client._loader.part import Part


def read(part: Part[Any], key: Callable[[Any], Any], limit: int | None = None) -> list[Any]:
    """``key`` of each item ``part`` yields, until its end or ``limit`` items."""
    out: list[Any] = []
    while limit is None or len(out) < limit:
        try:
            item = part.next()
        except StopIteration:
            break
        out.append(key(item))
    return out


def check_resumes(
    make_part: Callable[[], Part[Any]],
    n: int,
    key: Callable[[Any], Any] = lambda x: x,
    at: Iterable[int] = (),
    settle: Callable[[Part[Any]], None] = lambda part: None,
) -> None:
    """A part built by ``make_part`` yields ``n`` items. Run one ``k`` items (for each ``k`` of
    ``at``, and 0, 1, n // 2, n - 1, n), take its ``state_dict()`` — plain data, as a checkpoint
    holds it — and ``reset`` a fresh part with it: the rest must equal an uninterrupted run's.
    Then the first part, run on to its end, is ``reset`` with the same state and must give the
    same rest again (a reset moves a part that has read ahead). ``key`` makes items comparable
    (taken as each item arrives); ``settle`` runs before each ``state_dict`` (let a thread's
    read-ahead land, so a state that counts it is caught)."""
    part = make_part()
    try:
        whole = read(part, key)
    finally:
        part.close()
    assert len(whole) == n, f"an uninterrupted run yields {len(whole)} items, not {n}"
    for k in sorted({0, 1, n // 2, n - 1, n, *at}):
        first = make_part()
        try:
            assert read(first, key, k) == whole[:k]
            settle(first)
            state = json.loads(json.dumps(first.state_dict()))
            assert "next_step" in state, f"a part's state says where it is: {state}"
            fresh = make_part()
            try:
                fresh.reset(state)
                assert read(fresh, key) == whole[k:], f"a fresh part reset with the state after {k} items ({state})"
            finally:
                fresh.close()
            read(first, key)
            first.reset(state)
            assert read(first, key) == whole[k:], f"the part reset with the state after {k} items ({state}) once it ran on"
        finally:
            first.close()
