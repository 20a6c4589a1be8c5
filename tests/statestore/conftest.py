"""Shared fixtures of the state-store tests: a data server with daemons on loopback."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import pytest

from ffplane_harness.local_cluster import LocalCluster
from tests._servers import TOKEN, until
from tests.conftest import mounted_tmpfs


@pytest.fixture
def cluster(tmp_path: Path, data_dir: Path) -> Iterator[LocalCluster]:
    """A data server on loopback; start daemons with ``start_ring``."""
    with LocalCluster(tmp_path, data_dir, TOKEN) as c:
        c.start_dataserver()
        yield c


@contextmanager
def small_tmpfs(cluster: LocalCluster, node: int, mib: int = 48) -> Iterator[Path]:
    """Node ``node``'s root on a tmpfs of its own of ``mib`` MiB, so it can be filled (its
    daemons killed before it is unmounted)."""
    with mounted_tmpfs(cluster.root(node), f"size={mib}m,mode=0700") as where:
        try:
            yield where
        finally:
            for d in list(cluster.daemons):
                d.kill()
    with suppress(OSError):
        where.rmdir()


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
