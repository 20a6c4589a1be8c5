from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from tests._servers import Proc


def _serve(shm_root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "statestore",
        "serve",
        "--dataserver",
        "http://127.0.0.1:9",
        "--root",
        str(shm_root),
        "--port",
        "0",
        *extra,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_refuses_a_budget_the_tmpfs_cannot_hold(shm_root: Path) -> None:
    free_mb = os.statvfs(shm_root).f_bavail * os.statvfs(shm_root).f_frsize >> 20
    r = _serve(shm_root, "--budget-mb", str(free_mb + 1024))
    assert r.returncode == 2
    assert "MiB free" in r.stderr and "--shm-size" in r.stderr
    assert not (shm_root / "daemon.sock").exists()
    assert list(shm_root.iterdir()) == []  # before: daemon.lock and _index/ stayed behind


def test_a_refused_start_on_a_root_it_created_leaves_nothing(shm_root: Path) -> None:
    fresh = shm_root / "sub" / "root"
    r = _serve(fresh, "--budget-mb", str((os.statvfs(shm_root).f_bavail * os.statvfs(shm_root).f_frsize >> 20) + 1024))
    assert r.returncode == 2 and not fresh.exists()


def test_one_daemon_per_root(shm_root: Path, start_daemon: Callable[..., Proc]) -> None:
    start_daemon()
    r = _serve(shm_root, "--budget-mb", "64")
    assert r.returncode == 2 and "another statestore daemon already uses" in r.stderr


def test_bad_config_is_named(shm_root: Path) -> None:
    r = _serve(shm_root, "--window", "0")
    assert r.returncode == 2 and "window must be >= 1" in r.stderr
