from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from statestore import Daemon, DaemonConfig
from tests._servers import TOKEN, Proc, refused_daemon


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port another socket listens on: nothing else can bind it."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield int(taken.getsockname()[1])


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


def test_a_port_that_cannot_be_bound_leaves_the_root_as_it_found_it(shm_root: Path, taken_port: int) -> None:
    """The root is opened before the ports are bound; a start that never served closes it again."""
    fresh = shm_root / "fresh"
    bulk = refused_daemon(fresh, "--bulk-port", str(taken_port))  # bound in the app's start-up, after the HTTP port
    assert bulk.returncode == 3 and "address already in use" in bulk.stderr and "Application startup failed" in bulk.stderr
    assert not fresh.exists()  # before: the lock file and _index/ stayed behind
    http = refused_daemon(fresh, "--port", str(taken_port))  # bound before the app starts
    assert http.returncode == 1 and f"cannot listen on 127.0.0.1:{taken_port}" in http.stderr
    assert not fresh.exists()


def test_a_start_that_fails_midway_closes_what_it_had_started(shm_root: Path, taken_port: int, caplog: pytest.LogCaptureFixture) -> None:
    """The Daemon in this process: the root opened, the transport's sessions and the data cache
    started, then the bulk port is taken. Everything started is closed, in reverse order."""
    fresh = shm_root / "fresh"
    config = DaemonConfig(dataserver="http://127.0.0.1:9", root=fresh, host="127.0.0.1", bulk_port=taken_port, budget_mb=16)
    daemon = Daemon(config, TOKEN)
    assert (fresh / "daemon.lock").is_file() and (fresh / "_index").is_dir()
    daemon.bound(9)  # (never listened on: the start fails before anything is served)

    async def start(daemon: Daemon) -> None:
        async with daemon.running():
            raise AssertionError("started with its bulk port taken")

    with caplog.at_level(logging.ERROR, logger="asyncio"), pytest.raises(OSError, match="address already in use"):
        asyncio.run(start(daemon))
    del daemon
    gc.collect()  # an aiohttp session left open says so as it is collected
    assert not [r for r in caplog.records if "Unclosed" in r.getMessage()]
    assert not fresh.exists() and not config.socket_path.exists()  # the index closed, the lock let go, both removed
    with Daemon(config, TOKEN):  # the lock was let go: the root opens again at once
        assert (fresh / "daemon.lock").is_file()
    assert not fresh.exists()


def test_a_root_too_long_for_the_control_socket_is_refused_in_one_line(tmp_path: Path) -> None:
    root = tmp_path / ("r" * (110 - len(str(tmp_path))))  # its daemon.sock would not fit a Unix socket's path
    done = refused_daemon(root)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"statestore: error: --root is too long: its control socket {root / 'daemon.sock'} would be over 107 bytes"
    ]
    assert not root.exists()  # nothing made
