"""Test-side access to the process launcher, with the test suite's job token."""

from __future__ import annotations

import os
import subprocess
import sys
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


def refused_daemon(root: Path, *extra: str, token: bool = True) -> subprocess.CompletedProcess[str]:
    """``statestore serve`` run to its exit, for flags it must refuse (its data server is
    nowhere: a daemon that got past the checks would only retry); ``token``: with the job token."""
    cmd = [sys.executable, "-m", "statestore", "serve", "--dataserver", "http://127.0.0.1:9", "--root", str(root), "--port", "0", *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FFPLANE_")} | ({"FFPLANE_TOKEN": TOKEN} if token else {})
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False, env=env)
