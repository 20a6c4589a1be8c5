from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from tests._servers import Proc, refused_daemon


def test_refuses_a_budget_the_tmpfs_cannot_hold(shm_root: Path) -> None:
    free_mb = os.statvfs(shm_root).f_bavail * os.statvfs(shm_root).f_frsize >> 20
    r = refused_daemon(shm_root, "--budget-mb", str(free_mb + 1024))
    assert r.returncode == 2
    assert "MiB free" in r.stderr and "--shm-size" in r.stderr
    assert not (shm_root / "daemon.sock").exists()
    assert list(shm_root.iterdir()) == []  # before: daemon.lock and _index/ stayed behind


def test_a_refused_start_on_a_root_it_created_leaves_nothing(shm_root: Path) -> None:
    fresh = shm_root / "sub" / "root"
    r = refused_daemon(fresh, "--budget-mb", str((os.statvfs(shm_root).f_bavail * os.statvfs(shm_root).f_frsize >> 20) + 1024))
    assert r.returncode == 2 and not fresh.exists()


def test_one_daemon_per_root(shm_root: Path, start_daemon: Callable[..., Proc]) -> None:
    start_daemon()
    r = refused_daemon(shm_root, "--budget-mb", "64")
    assert r.returncode == 2 and "another statestore daemon already uses" in r.stderr


def test_bad_config_is_named(shm_root: Path) -> None:
    r = refused_daemon(shm_root, "--window", "0")
    assert r.returncode == 2 and "window must be >= 1" in r.stderr
