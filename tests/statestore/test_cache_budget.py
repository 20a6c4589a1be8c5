"""The daemon's budget bounds what its node cache holds, at every moment."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dataserver.ingest import IngestConfig, ingest
from tests._servers import TOKEN, Proc
from tests.conftest import create_job
from trainer_client import CapacityError, DataLoader

ROW_INTS = 16384  # 64 KiB a row: a step of 16 rows is 1 MiB


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """One dataset, ``tokens``, of 256 rows of 64 KiB."""
    root = tmp_path / "datasets"
    root.mkdir()
    rows = np.arange(256 * ROW_INTS, dtype=np.int32).reshape(256, ROW_INTS)
    pq.write_table(pa.table({"tokens": pa.array(list(rows))}), tmp_path / "big.parquet")
    ingest(IngestConfig([tmp_path / "big.parquet"], root / "tokens", progress=False))
    return root


@pytest.mark.parametrize(
    ("rows", "budget_mb", "window"),
    [
        (16, 3, 4),  # 1 MiB steps: the window alone would want 4 MiB, plus 2 kept
        (3, 1, 8),  # 192 KiB steps, prefetched 4 a request: the window and its runs would want 2.3 MiB
    ],
)
def test_the_cache_never_holds_more_than_the_budget(
    dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path, rows: int, budget_mb: int, window: int
) -> None:
    create_job(dataserver, dp=1, batch_per_rank=rows, max_steps=16)
    daemon = start_daemon("--budget-mb", str(budget_mb), "--window", str(window))
    seen, got = [], []
    for batch in DataLoader("j1", 0, dataserver=dataserver.url, token=TOKEN, socket_path=shm_root / "daemon.sock"):
        got.append(batch["tokens"][:, 0].tolist())
        time.sleep(0.05)  # prefetch has time to fill what it may
        seen.append(httpx.get(daemon.url + "/v1/cache").json())
    assert len(seen) == 16 and len({tuple(g) for g in got}) == 16  # every step, each its own rows
    budget = budget_mb << 20
    # before: 4-6 MiB cached at once, from the first steps on
    assert max(c["bytes"] for c in seen) <= budget and seen[-1]["peak_bytes"] <= budget
    stream = seen[-1]["streams"][0]
    # each request put off for room is one the data server answered for nothing (before: 61
    # requests for the 16 small steps, the runs of one pass each counting on the same free room)
    assert stream["fetched"] >= 16 and stream["requests"] <= 2 * stream["fetched"], stream


def test_a_step_larger_than_the_budget_is_a_clear_error(dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    create_job(dataserver, dp=1, batch_per_rank=32, max_steps=4)  # 2 MiB steps
    daemon = start_daemon("--budget-mb", "1")
    with pytest.raises(CapacityError, match="does not fit in the daemon's budget of 1.0 MiB"):
        next(iter(DataLoader("j1", 0, dataserver=dataserver.url, token=TOKEN, socket_path=shm_root / "daemon.sock")))
    assert httpx.get(daemon.url + "/v1/cache").json()["bytes"] == 0  # before: 2 MiB cached against 1
    assert "data server failing" not in daemon.log()  # room short here is not the server's fault (before: passed over)
