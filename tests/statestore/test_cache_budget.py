"""The daemon's budget bounds what its node cache holds, at every moment."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dataserver.ingest import IngestConfig, ingest
from tests._servers import TOKEN, Proc, until
from tests.conftest import create_job
from trainer_client import CapacityError, Checkpointer, DataLoader

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


def test_the_cache_and_the_checkpoint_slots_share_one_budget(dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    """The data cache, the slots and the replicas are given one ledger of the budget: with 2 MiB
    of slots held, prefetching stops at the 10 MiB left of 12, though the window wants 16."""
    create_job(dataserver, dp=1, batch_per_rank=16, max_steps=16)  # 1 MiB steps
    budget = 12 << 20
    daemon = start_daemon("--budget-mb", "12", "--window", "16")
    ck = Checkpointer("j1", socket_path=shm_root / "daemon.sock")
    ck.save(1, {"w": torch.ones(1 << 18)})  # 1 MiB a slot, 2 slots
    ck.close()
    slots = httpx.get(daemon.url + "/v1/state").json()["memory"]["slots_bytes"]
    assert slots >= 2 << 20
    memory = []
    for _ in DataLoader("j1", 0, dataserver=dataserver.url, token=TOKEN, socket_path=shm_root / "daemon.sock"):
        time.sleep(0.05)  # prefetch has time to fill what it may
        memory.append(httpx.get(daemon.url + "/v1/state").json()["memory"])
    assert len(memory) == 16 and all(m["slots_bytes"] == slots and m["free_bytes"] >= 0 for m in memory)
    peak = httpx.get(daemon.url + "/v1/cache").json()["peak_bytes"]  # the most it held, or had reserved, at any moment
    assert 0 < peak <= budget - slots  # a cache counting only itself fills the whole 12 MiB


def test_a_step_larger_than_the_budget_is_a_clear_error(dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    create_job(dataserver, dp=1, batch_per_rank=32, max_steps=4)  # 2 MiB steps
    daemon = start_daemon("--budget-mb", "1")
    with pytest.raises(CapacityError, match="does not fit in the daemon's budget of 1.0 MiB"):
        next(iter(DataLoader("j1", 0, dataserver=dataserver.url, token=TOKEN, socket_path=shm_root / "daemon.sock")))
    assert httpx.get(daemon.url + "/v1/cache").json()["bytes"] == 0  # before: 2 MiB cached against 1
    assert "data server failing" not in daemon.log()  # room short here is not the server's fault (before: passed over)


def _wide_dataset(data_dir: Path, rows: int) -> None:
    """A dataset ``wide`` of ``rows`` rows of 1 MiB, added to the served folder (the data
    server's catalog opens a dataset when a job first asks for it)."""
    table = pa.table({"tokens": pa.array(list(np.arange(rows * 16 * ROW_INTS, dtype=np.int32).reshape(rows, 16 * ROW_INTS)))})
    pq.write_table(table, data_dir.parent / "wide.parquet")
    ingest(IngestConfig([data_dir.parent / "wide.parquet"], data_dir / "wide", progress=False))


def _folder_bytes(folder: Path) -> int:
    """Bytes of every file under ``folder`` now, those being written included."""
    total = 0
    for path in folder.rglob("*"):
        try:
            total += path.stat().st_size if path.is_file() else 0
        except FileNotFoundError:  # unlinked while listed
            pass
    return total


def test_steps_over_16_mib_stay_within_the_budget(
    data_dir: Path, dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path
) -> None:
    # Steps over 16 MiB come without a Content-Length (the data server streams them): the cache
    # reserved its estimate of their size, nothing for a stream's first steps, and wrote them whole.
    _wide_dataset(data_dir, 40)
    create_job(dataserver, dataset="wide", dp=2, batch_per_rank=20, max_steps=5)  # ~20 MiB steps
    daemon = start_daemon("--budget-mb", "64")
    sizes: list[int] = []
    reading = threading.Event()

    def sample() -> None:
        while not reading.is_set():
            sizes.append(_folder_bytes(shm_root / "j1" / "data"))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, name="sample cache folder")
    sampler.start()
    try:
        loaders = [DataLoader("j1", r, dataserver=dataserver.url, token=TOKEN, socket_path=shm_root / "daemon.sock") for r in (0, 1)]
        got = [(int(a["tokens"][0, 0]), int(b["tokens"][0, 0])) for a, b in zip(*loaders)]
        for loader in loaders:
            loader.close()
    finally:
        reading.set()
        sampler.join()
    assert len(got) == 5
    cache = httpx.get(daemon.url + "/v1/cache").json()
    budget = 64 << 20
    assert max(sizes) <= budget, f"{max(sizes) / 2**20:.1f} MiB on disk against a budget of 64 MiB"
    assert max(sizes) <= cache["peak_bytes"] <= budget, (max(sizes), cache["peak_bytes"])


def test_a_streamed_step_larger_than_the_budget_is_a_clear_error(
    data_dir: Path, dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path
) -> None:
    _wide_dataset(data_dir, 20)
    create_job(dataserver, dataset="wide", dp=1, batch_per_rank=20, max_steps=2)  # ~20 MiB steps, sent without a size
    daemon = start_daemon("--budget-mb", "16")
    with pytest.raises(CapacityError, match=r"step 0 of j1/0 \(over 1\d\.\d MiB\) does not fit in the daemon's budget of 16.0 MiB"):
        next(iter(DataLoader("j1", 0, dataserver=dataserver.url, token=TOKEN, socket_path=shm_root / "daemon.sock")))
    cache = httpx.get(daemon.url + "/v1/cache").json()
    # before: the step cached whole, 20 MiB against 16, and read
    assert cache["bytes"] == 0 and cache["peak_bytes"] <= 16 << 20 and _folder_bytes(shm_root / "j1" / "data") == 0, cache


@pytest.mark.parametrize("rows", [1, 16])  # 64 KiB steps, fetched in runs; 1 MiB steps, one by one
def test_the_end_of_a_job_is_logged_once_a_stream(dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path, rows: int) -> None:
    create_job(dataserver, dp=2, batch_per_rank=rows, max_steps=20)
    daemon = start_daemon("--window", "8")
    for rank in (0, 1):
        loader = DataLoader("j1", rank, dataserver=dataserver.url, token=TOKEN, socket_path=shm_root / "daemon.sock")
        assert sum(1 for _ in loader) == 20
        loader.close()
    streams = until(lambda: [s for s in httpx.get(daemon.url + "/v1/cache").json()["streams"] if not s["fetching"]], what="fetches done")
    assert [s["end_step"] for s in streams] == [20, 20], streams
    time.sleep(0.3)  # (a prefetch past the end would be logged by now)
    lines = [json.loads(line) for line in daemon.log().splitlines() if line.startswith("{")]
    ends = [e for e in lines if e["logger"] == "statestore.data_cache" and e["level"] != "debug" and "416" in e.get("error", "")]
    # before: a line for every fetch past the end (runs: 16 a stream, the run and its steps one by
    # one; single steps: 3 a stream, the prefetches in flight)
    assert sorted(e["dp_rank"] for e in ends) == [0, 1], [(e["msg"], e["dp_rank"], e["step"]) for e in ends]


def test_a_restart_under_a_smaller_budget_drops_cached_steps_said_once_and_refuses_to_drop_checkpoints(
    dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path
) -> None:
    """Before: a root holding more than the new --budget-mb was reattached silently, over budget."""
    create_job(dataserver, dp=1, batch_per_rank=16, max_steps=16)  # 1 MiB steps
    daemon = start_daemon("--budget-mb", "32", "--window", "8")
    loader = iter(DataLoader("j1", 0, dataserver=dataserver.url, token=TOKEN, socket_path=shm_root / "daemon.sock"))
    for _ in range(3):
        next(loader)
    until(lambda: httpx.get(daemon.url + "/v1/cache").json()["bytes"] >= 8 << 20, what="the window prefetched")
    ck = Checkpointer("j1", socket_path=shm_root / "daemon.sock")
    ck.save(2, {"w": torch.ones(1 << 18)})  # 1 MiB a slot
    ck.close()
    state = httpx.get(daemon.url + "/v1/state").json()
    held = state["memory"]["slots_bytes"] + state["memory"]["replicas_bytes"]
    daemon.stop()

    smaller = -(-(held + (2 << 20)) // (1 << 20))  # the checkpoints and 2 MiB more
    daemon = start_daemon("--budget-mb", str(smaller), "--window", "8")
    assert httpx.get(daemon.url + "/v1/cache").json()["bytes"] <= 2 << 20
    said = [line for line in daemon.log().splitlines() if "more than --budget-mb" in line]
    assert len(said) == 1 and "dropped" in said[0] and "checkpoint slots and replicas kept" in said[0], said
    got = Checkpointer("j1", socket_path=shm_root / "daemon.sock").restore()
    assert got is not None and got.step == 2
    daemon.stop()

    with pytest.raises(RuntimeError) as refused:  # below what the checkpoints hold: refused, nothing dropped
        start_daemon("--budget-mb", str(held // (1 << 20) - 1))
    assert "of checkpoint slots" in str(refused.value) and "Traceback" not in str(refused.value)
    start_daemon("--budget-mb", str(smaller))
    got = Checkpointer("j1", socket_path=shm_root / "daemon.sock").restore()
    assert got is not None and got.step == 2
