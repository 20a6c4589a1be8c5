"""Shared fixtures of the state-store tests: a data server with daemons on loopback."""

from __future__ import annotations

from collections.abc import Iterator
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


def start_ring(c: LocalCluster, n: int, *extra: str) -> None:
    """``n`` more daemons (64 KiB gate chunks, 64 MiB budget), returning once all are in the ring."""
    for _ in range(n):
        c.start_daemon("--gate-chunk-kb", "64", *extra, budget_mb=64)
    assert c.dataserver is not None
    url = c.dataserver.url
    until(lambda: len(httpx.get(f"{url}/v1/nodes").json()["ring"]) == len(c.roots), what="every daemon in the ring")


def daemon_state(c: LocalCluster, i: int) -> dict[str, Any]:
    return httpx.get(c.daemons[i].url + "/v1/state").json()
