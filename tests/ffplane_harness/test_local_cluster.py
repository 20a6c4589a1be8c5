"""The local cluster harness cleans up after makers that could not (killed before ``close()``)."""

from __future__ import annotations

import secrets
import shutil
import subprocess
import sys
from pathlib import Path

from ffplane_harness.local_cluster import LocalCluster, orphaned_roots


def test_a_new_cluster_removes_the_daemon_roots_of_makers_that_died_and_only_those(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    orphan = shm / f"ffplane-local-{int(dead.stdout)}-0"  # a maker SIGTERMed mid-run left this
    (orphan / "_index").mkdir(parents=True)
    live = shm / "ffplane-local-1-0"  # pid 1 is alive: never someone else's to remove
    live.mkdir()
    assert orphaned_roots(shm) == [orphan]
    with LocalCluster(tmp_path / "work", tmp_path / "data", secrets.token_hex(8), shm_parent=shm):
        assert not orphan.exists() and live.is_dir()


def test_two_clusters_of_one_process_run_side_by_side_and_each_removes_only_its_own_roots(tmp_path: Path) -> None:
    """A paired benchmark keeps two clusters up at once; their daemons' roots once collided (``another statestore daemon already uses ...``)."""
    token = secrets.token_hex(8)
    shm = Path("/dev/shm") / f"ffplane-test-{token}"  # daemons refuse a root off tmpfs
    shm.mkdir()
    for d in ("a", "b", "data"):
        (tmp_path / d).mkdir()
    try:
        with LocalCluster(tmp_path / "a", tmp_path / "data", token, shm_parent=shm) as a:
            with LocalCluster(tmp_path / "b", tmp_path / "data", token, shm_parent=shm) as b:
                for cluster in (a, b):
                    cluster.start_dataserver()
                    cluster.start_daemon(budget_mb=64)
                assert a.root(0) != b.root(0) and a.root(0).is_dir() and b.root(0).is_dir()
                assert orphaned_roots(shm) == []  # their maker is alive: neither root is anyone's to remove
            assert not b.root(0).exists() and a.root(0).is_dir()
        assert not a.root(0).exists()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
