"""Test-side access to the process launcher, with the test suite's job token."""

from __future__ import annotations

from pathlib import Path

from trainer_client.local_cluster import Proc
from trainer_client.local_cluster import start as _start

TOKEN = "test-token-0123456789"


def start(module: str, args: list[str], workdir: Path, name: str, env: dict[str, str] | None = None) -> Proc:
    return _start(module, args, workdir, name, TOKEN, env)


__all__ = ["TOKEN", "Proc", "start"]
