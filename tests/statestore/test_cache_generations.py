"""The node cache keeps its steps to the job's plan: a step it cached before an elastic change (a
new generation from a step it had prefetched) is dropped and fetched again under the new plan,
before a reader can map it by its name — the daemon's check, not the reader's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pyarrow as pa
import pytest

from dataserver import Generation, Planner
from ffplane_contract.control import Get, Open
from ffplane_contract.dataserver_http import GenerationView, JobView
from ffplane_contract.plan import AHEAD, CURRENT, STALE, JobPlan
from tests._servers import TOKEN, Proc, until
from tests.conftest import create_job
from trainer_client._daemon_client import DaemonClient

OLD, NEW = Generation(0, 2, 8), Generation(3, 3, 5)  # an elastic restart from step 3 with another layout


def _batches(path: Path) -> dict[int, tuple[int, list[int]]]:
    """Step → (generation, sample indices) of each batch of a cached file."""
    reader = pa.ipc.open_stream(pa.memory_map(str(path)))
    out = {}
    while True:
        try:
            item = reader.read_next_batch_with_custom_metadata()
        except StopIteration:
            return out
        meta = item.custom_metadata
        out[int(meta[b"step"])] = (int(meta[b"generation"]), item.batch.column("_sample_index").to_pylist())


def _view(*starts: int) -> JobView:
    """A data server's view of a job whose generations start at ``starts``."""
    gens = [GenerationView(start_step=s, dp=1, batch_per_rank=1) for s in starts]
    return JobView(name="j1", dataset=None, seed=0, max_steps=None, generations=gens, served_step=None)


def test_a_plan_says_which_files_are_stale_and_which_are_ahead_of_it() -> None:
    plan = JobPlan.from_view(_view(10, 0))
    assert [plan.generation(s) for s in (0, 9, 10, 99)] == [0, 0, 10, 10]
    assert plan.compare(8, (0, 0, 10, 10)) == CURRENT
    assert plan.compare(8, (0, 0, 0, 10)) == STALE  # step 10 planned before generation 10
    assert plan.compare(8, (0, 8, 10, 10)) == AHEAD  # a generation from step 9 this plan lacks
    assert plan.compare(8, None) == CURRENT  # untagged: not checked
    with pytest.raises(ValueError, match="first generation starts at step 3"):
        JobPlan.from_view(_view(3))
    with pytest.raises(ValueError, match="has no generations"):
        JobPlan.from_view(_view())


@pytest.mark.parametrize("fetch_steps", ["1", "16"])  # a file a step, and runs of small steps in one file
def test_steps_cached_before_a_new_generation_are_fetched_again_under_it(
    dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path, fetch_steps: str
) -> None:
    create_job(dataserver, max_steps=30)
    daemon = start_daemon("--window", "8", "--fetch-steps", fetch_steps)
    steps_dir = shm_root / "j1" / "data" / "0"
    client = DaemonClient(shm_root / "daemon.sock", 30)
    client.call(Open("j1", 0, TOKEN))
    client.call(Get(0))

    def cached() -> list[int]:
        streams = httpx.get(daemon.url + "/v1/cache").json()["streams"]
        return list(streams[0]["steps"]) if streams else []

    until(lambda: set(range(8)) <= set(cached()), what="steps 0-7 cached under the first plan")
    old = {s: b for f in steps_dir.glob("*.arrow") for s, b in _batches(f).items()}
    assert {old[s][0] for s in range(8)} == {0}
    client.close()
    r = httpx.post(
        dataserver.url + "/v1/jobs/j1/generations",
        json={"start_step": NEW.start_step, "dp": NEW.dp, "batch_per_rank": NEW.batch_per_rank, "replan_served": True},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert r.status_code == 200, r.text
    plan = Planner(300, 5, [OLD, NEW])

    client = DaemonClient(shm_root / "daemon.sock", 30)
    try:
        client.call(Open("j1", 0, TOKEN))
        # once 'open' is answered, no file a reader finds by a step's name holds the old plan's step
        for f in steps_dir.glob("*.arrow"):
            for step, (gen, _) in _batches(f).items():
                assert gen == plan.generation_at(step)[0].start_step, f"{f.name} holds step {step} of generation {gen}"
        for step in range(8):
            reply = client.call(Get(step))
            gen, indices = _batches(shm_root / reply.path)[step]
            assert (gen, indices) == (plan.generation_at(step)[0].start_step, plan.plan(0, step).indices.tolist())
            if fetch_steps == "1" and step < NEW.start_step:
                assert reply.hit, f"step {step} of the first generation was dropped too"
    finally:
        client.close()
    assert old[5][1] != plan.plan(0, 5).indices.tolist()  # (the old plan's step was another batch)
    assert "stale steps dropped" in daemon.log()
