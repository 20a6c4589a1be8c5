"""Small steps are prefetched several per request into one file, read by the reader from one
mapping: each step the same batch a request for that step alone returns."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pytest

from statestore.data_cache import check_run
from statestore.dataservers import DataServers
from tests._servers import TOKEN, Proc
from tests.conftest import create_job
from trainer_client import DataLoader


def _stream(steps: list[int]) -> bytes:
    """An IPC stream of one record batch per step, as the data server writes it."""
    sink = pa.BufferOutputStream()
    schema = pa.schema([("tokens", pa.int32())])
    with pa.ipc.new_stream(sink, schema) as writer:
        for step in steps:
            writer.write_batch(pa.record_batch([pa.array([step, step + 1], pa.int32())], schema), custom_metadata={"step": str(step)})
    return sink.getvalue().to_pybytes()


def test_check_run_takes_a_stream_of_exactly_the_steps_asked_for() -> None:
    check_run(_stream([5, 6, 7]), [5, 6, 7])


@pytest.mark.parametrize(
    ("asked", "error"),
    [([5, 6], "more than the 2 steps"), ([5, 6, 7, 8], "ends before step 8"), ([5, 7, 8], "for step 7 says step b'6'")],
)
def test_check_run_refuses_a_stream_that_is_not_the_steps_asked_for(asked: list[int], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        check_run(_stream([5, 6, 7]), asked)


def test_runs_of_one_stream_take_turns_over_the_data_servers() -> None:
    """In a steady stream runs start ``fetch_steps`` apart: by their first step alone every run
    would go to the same server (of 2 or 4); by run they alternate as single steps do."""
    for n in (2, 4):
        servers = DataServers(",".join(f"http://10.0.0.{i}:8470" for i in range(n)))
        firsts = [servers.for_run("j1/0", start, 4)[0] for start in range(0, 4 * 2 * n, 4)]
        assert set(firsts) == set(servers.urls) and all(a != b for a, b in zip(firsts, firsts[1:]))
        assert sorted(servers.for_run("j1/0", 8, 4)) == sorted(servers.urls)  # each run can fail over to every server


def test_small_steps_arrive_in_runs_each_the_batch_a_single_fetch_returns(
    dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path
) -> None:
    # 30 steps: the last run asked for crosses the job's end, is refused (416) and is fetched
    # again step by step, which finds the end as a single fetch does
    create_job(dataserver, dp=1, batch_per_rank=8, max_steps=30)
    daemon = start_daemon("--fetch-steps", "4")
    read: dict[int, list[list[int]]] = {}
    loader = DataLoader("j1", 0, dataserver=dataserver.url, token=TOKEN, socket_path=shm_root / "daemon.sock")
    for i, batch in enumerate(loader):
        read[i] = batch["tokens"].tolist()
    assert sorted(read) == list(range(30))
    for step, tokens in read.items():
        alone = httpx.get(
            f"{dataserver.url}/v1/jobs/j1/batches",
            params={"dp_rank": 0, "start": step, "count": 1},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        batch, meta = pa.ipc.open_stream(alone.content).read_next_batch_with_custom_metadata()
        assert meta[b"step"] == str(step).encode() and batch.column("tokens").to_pylist() == tokens, f"step {step}"
    stream = httpx.get(daemon.url + "/v1/cache").json()["streams"][0]
    # before: one request per step (30 or more; here ~20, some steps fetched alone for a reader
    # that outran the prefetch, and the runs past the end)
    assert stream["fetched"] >= 30 and stream["requests"] < stream["fetched"], stream
    assert stream["end_step"] == 30  # the run past the end was refused, and its steps alone found where it is


def _steady_read(dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path) -> tuple[dict[str, Any], list[str]]:
    """160 steps read by a reader that computes (the prefetch keeps ahead of it), behind runs of
    16 and a window of 4, of a job that runs on past them (no run meets its end): the daemon's
    account of the stream, and the cache's files when the reader is at step 100."""
    create_job(dataserver, dp=1, batch_per_rank=8, max_steps=1000)
    daemon = start_daemon("--fetch-steps", "16", "--window", "4")
    loader = DataLoader("j1", 0, dataserver=dataserver.url, token=TOKEN, socket_path=shm_root / "daemon.sock", end_step=160)
    steps, names = [], []
    for batch in loader:
        steps.append(int(loader.next_step) - 1)
        assert len(batch["tokens"]) == 8
        time.sleep(0.005)
        if len(steps) == 100:
            names = sorted(p.name for p in (shm_root / "j1" / "data" / "0").glob("*.arrow"))
    loader.close()
    assert steps == list(range(160))
    return httpx.get(daemon.url + "/v1/cache").json()["streams"][0], names


def test_a_run_is_one_file_and_its_reader_tells_the_daemon_its_position_once_a_file(
    dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path
) -> None:
    # A run was split into 16 files (16 creates, renames, index records, unlinks, maps), and the
    # reader sent a Get every step: 160 for 160 steps. Now a run is one file, mapped once, and the
    # reader reports on entering a file (~11 files here: the first step comes alone, as the step
    # a reader waits for; a step it outran the prefetch to also does), and the daemon fetches the
    # next run on that report.
    stream, names = _steady_read(dataserver, start_daemon, shm_root)
    assert 1 <= len(names) <= 4, names  # files of 16 steps: the one read, the one before and the next
    assert stream["hits"] + stream["misses"] <= 20, stream
    assert stream["files"] * 16 >= len(stream["steps"]) and stream["files"] <= 4, stream


def test_a_run_reaches_fetch_steps_past_the_window_not_only_a_window(
    dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path
) -> None:
    # A request brings 16 new steps. When a run could reach only a window past the window, a
    # steady reader got ~5 steps a request, and the data server's per-request CPU was paid 3x as
    # often (bench/step_cost.py's data server column).
    stream, _ = _steady_read(dataserver, start_daemon, shm_root)
    assert stream["fetched"] >= 160 and stream["requests"] <= stream["fetched"] // 8, stream
