"""Shared fixtures of the state-store tests: a data server with daemons on loopback."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from ffplane_harness.local_cluster import LocalCluster
from tests._servers import TOKEN, Proc, start, until
from tests.conftest import make_datasets, mounted_tmpfs


@pytest.fixture
def cluster(tmp_path: Path, data_dir: Path) -> Iterator[LocalCluster]:
    """A data server on loopback; start daemons with ``start_ring``."""
    with LocalCluster(tmp_path, data_dir, TOKEN) as c:
        c.start_dataserver()
        yield c


@dataclass
class SharedNode:
    """A data server and a node daemon that a module's tests share: tests that neither kill,
    stop nor restart them, nor need flags of their own; each test keeps to its own job (``job``)."""

    daemon: Proc
    root: Path

    @property
    def sock(self) -> Path:
        return self.root / "daemon.sock"

    def roles(self, job: str) -> list[dict[str, Any]]:
        """``/v1/state``'s roles of ``job`` alone."""
        return [r for r in httpx.get(self.daemon.url + "/v1/state").json()["roles"] if r["job"] == job]


@pytest.fixture(scope="module")
def shared_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedNode]:
    """Started once per module (two processes' start-up saved per test); removed afterwards, even on failure."""
    work = tmp_path_factory.mktemp("shared-node")
    root = Path("/dev/shm") / f"ffplane-test-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    dataserver = start("dataserver", ["serve", "--data-dir", str(make_datasets(work)), "--port", "0"], work, "dataserver")
    try:
        args = ["serve", "--dataserver", dataserver.url, "--root", str(root), "--port", "0", "--budget-mb", "1024"]
        daemon = start("statestore", args, work, "daemon")
        try:
            yield SharedNode(daemon, root)
        finally:
            daemon.kill()
    finally:
        dataserver.stop()
        shutil.rmtree(root, ignore_errors=True)


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
