"""Shared fixtures of the state-store tests: a data server with daemons on loopback."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from ffplane_harness.local_cluster import LocalCluster
from tests._servers import TOKEN, until


@pytest.fixture
def cluster(tmp_path: Path, data_dir: Path) -> Iterator[LocalCluster]:
    """A data server on loopback; start daemons with ``start_ring``."""
    with LocalCluster(tmp_path, data_dir, TOKEN) as c:
        c.start_dataserver()
        yield c


@contextmanager
def small_tmpfs(cluster: LocalCluster, node: int, mib: int = 48) -> Iterator[Path]:
    """Node ``node``'s root on a tmpfs of its own of ``mib`` MiB (unmounted after, its daemons
    killed first), so it can be filled; skipped without root."""
    where = cluster.root(node)
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0700", "tmpfs", str(where)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield where
    finally:
        for d in list(cluster.daemons):
            d.kill()
        subprocess.run(["umount", "-l", str(where)], check=False)
        for _ in range(20):
            try:
                where.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)


def fill(where: Path, leave_bytes: int = 0) -> Path:
    """Fill the file system of ``where`` up to ``leave_bytes`` free with a file, returned."""
    filler = where / "filler"
    free = shutil.disk_usage(where).free - leave_bytes
    with open(filler, "ab") as f:
        try:
            f.write(bytes(max(free, 0)))
        except OSError:
            pass
    return filler


def start_ring(c: LocalCluster, n: int, *extra: str) -> None:
    """``n`` more daemons (64 KiB gate chunks, 64 MiB budget), returning once all are in the ring."""
    for _ in range(n):
        c.start_daemon("--gate-chunk-kb", "64", *extra, budget_mb=64)
    assert c.dataserver is not None
    url = c.dataserver.url
    until(lambda: len(httpx.get(f"{url}/v1/nodes").json()["ring"]) == len(c.roots), what="every daemon in the ring")


def daemon_state(c: LocalCluster, i: int) -> dict[str, Any]:
    return httpx.get(c.daemons[i].url + "/v1/state").json()
