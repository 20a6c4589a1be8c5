"""The local cluster harness cleans up after makers that could not (killed before ``close()``)."""

from __future__ import annotations

import secrets
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
