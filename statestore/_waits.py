"""Waits with a time limit that run in the waiting task.

``asyncio.wait_for`` on a coroutine wraps it in a new task, and on any awaitable adds a waiter
future, a done-callback and a timer: on the replication path (a commit waiting for its replica,
the replicator waiting for work, a push waiting for its reply) that was several tasks and waiters
per save, each a trip through the event loop (``bench/daemon_profile.py`` counts them per save
pair). ``asyncio.timeout`` (Python 3.11+) puts one timer on the task that waits; on 3.10 these
fall back to ``wait_for``.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def until_set(event: asyncio.Event, timeout: float) -> bool:
    """Wait at most ``timeout`` seconds for ``event``; whether it is set."""
    if event.is_set():
        return True
    try:
        await within(event.wait(), timeout)
    except asyncio.TimeoutError:
        pass
    return event.is_set()


async def within(aw: Awaitable[T], timeout: float) -> T:
    """``await aw``, raising ``asyncio.TimeoutError`` (and cancelling it) after ``timeout`` seconds."""
    if sys.version_info < (3, 11):
        return await asyncio.wait_for(aw, timeout)
    async with asyncio.timeout(timeout):
        return await aw
