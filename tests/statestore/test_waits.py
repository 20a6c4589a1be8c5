"""The replication path's timed waits: the answers and the cancellation ``wait_for`` gave, but run
in the waiting task, with no task of their own (Python 3.11+)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from statestore._waits import until_set, within


def test_until_set_says_whether_the_event_came_in_time_and_waits_in_the_callers_task() -> None:
    async def run() -> tuple[bool, bool, bool, list[int]]:
        loop = asyncio.get_running_loop()
        late, soon, already = asyncio.Event(), asyncio.Event(), asyncio.Event()
        already.set()
        tasks_while_waiting: list[int] = []
        loop.call_later(0.005, lambda: tasks_while_waiting.append(len(asyncio.all_tasks())))
        loop.call_later(0.01, soon.set)
        got = await until_set(soon, 5.0), await until_set(late, 0.02), await until_set(already, 0.0)
        return (*got, tasks_while_waiting)

    soon, late, already, tasks = asyncio.run(run())
    assert (soon, late, already) == (True, False, True)
    if sys.version_info >= (3, 11):
        assert tasks == [1]  # only the caller's: wait_for(event.wait()) made a second


def test_within_returns_the_result_or_times_out_and_cancels_what_it_waited_for() -> None:
    async def run() -> tuple[int, bool]:
        loop = asyncio.get_running_loop()
        answered = loop.create_future()
        loop.call_later(0.01, answered.set_result, 7)
        value = await within(answered, 5.0)
        never = loop.create_future()
        with pytest.raises(asyncio.TimeoutError):
            await within(never, 0.02)
        return value, never.cancelled()

    assert asyncio.run(run()) == (7, True)
