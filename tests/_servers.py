"""Test-side access to the process launcher, with the test suite's job token."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ffplane_harness.local_cluster import Proc
from ffplane_harness.local_cluster import start as _start

TOKEN = "test-token-0123456789"
T = TypeVar("T")


def until(fn: Callable[[], T], timeout_s: float = 30, what: str = "condition") -> T:
    """Poll ``fn`` until it returns something truthy; that value. Waits are bounds, not timings."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached in {timeout_s}s (last: {value!r})")
        time.sleep(0.05)


def start(module: str, args: list[str], workdir: Path, name: str, env: dict[str, str] | None = None) -> Proc:
    return _start(module, args, workdir, name, TOKEN, env)


__all__ = ["TOKEN", "Proc", "start", "until"]
