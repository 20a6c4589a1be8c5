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
    assert r.returncode == 2 and "--window: expected an integer >= 1" in r.stderr
    r = refused_daemon(shm_root, "--fetch-steps", "300")  # more than a data server answers in one request
    assert r.returncode == 2 and "--fetch-steps: expected an integer in 1..256" in r.stderr


def test_refuses_to_start_without_a_token_and_leaves_nothing(shm_root: Path) -> None:
    fresh = shm_root / "fresh"
    r = refused_daemon(fresh, token=False)
    assert r.returncode == 2 and "no job token" in r.stderr and "FFPLANE_TOKEN" in r.stderr
    assert not fresh.exists()


def test_refuses_a_root_off_tmpfs_unless_allowed(tmp_path: Path) -> None:
    root = tmp_path / "on-disk"
    r = refused_daemon(root)
    assert r.returncode == 2 and "not tmpfs" in r.stderr and "--allow-non-tmpfs" in r.stderr
    assert not root.exists()
    # allowed: it gets past the check (and then refuses the budget its disk cannot promise, or runs)
    allowed = refused_daemon(root, "--allow-non-tmpfs", "--budget-mb", str(1 << 30))
    assert "not tmpfs" not in allowed.stderr and allowed.returncode == 2


def test_a_data_server_url_without_a_scheme_is_named(shm_root: Path) -> None:
    r = refused_daemon(shm_root, "--dataserver", "localhost:28470")
    assert r.returncode == 2 and "'localhost:28470' is not a URL like http://" in r.stderr


def test_an_unknown_log_level_is_a_usage_error_not_a_traceback(shm_root: Path) -> None:
    r = refused_daemon(shm_root, "--log-level", "verbose")
    assert r.returncode == 2 and "invalid choice: 'verbose'" in r.stderr and "Traceback" not in r.stderr
