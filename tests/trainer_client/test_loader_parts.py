"""Each part of the DataLoader resumes exactly (``_resume.check_resumes``), over a real data
server and, where it reads one, a real node daemon."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from ffplane_contract.plan import JobPlan
from tests._servers import TOKEN, Proc
from tests.conftest import create_job
from tests.trainer_client._resume import check_resumes, read
from trainer_client._loader.generations import GenerationCheck, job_plan
from trainer_client._loader.look_ahead import LookAhead
from trainer_client._loader.micro_batches import MicroBatches
from trainer_client._loader.part import Fetched, Part, Stage, State
from trainer_client._loader.placement import Placement
from trainer_client._loader.source import StepSource
from trainer_client.pinned import cuda_present

STEPS = 8


def _rows(item: Fetched) -> tuple[int, int, list[int]]:
    return item.step, item.generation, item.batch.column("_sample_index").to_pylist()


def _source(dataserver: Proc, socket_path: Path, window: int = 3) -> StepSource:
    return StepSource(
        "j1",
        1,
        socket_path=socket_path,
        dataserver=dataserver.url,
        token=TOKEN,
        timeout_s=30,
        reconnect_s=5,
        http_window=window,
        end_step=STEPS,
    )


@pytest.fixture
def sock(request: pytest.FixtureRequest, dataserver: Proc, shm_root: Path) -> Path:
    """The socket a source tries: a daemon's, or (``dataserver``) one that is not there."""
    create_job(dataserver)
    if request.param == "dataserver":
        return shm_root / "absent.sock"
    request.getfixturevalue("start_daemon")()
    return shm_root / "daemon.sock"


def _new_generation(dataserver: Proc, start_step: int, **extra: Any) -> None:
    body = {"start_step": start_step, "dp": 3, "batch_per_rank": 5, **extra}
    r = httpx.post(dataserver.url + "/v1/jobs/j1/generations", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("sock", ["daemon", "dataserver"], indirect=True)
def test_the_source_resumes(dataserver: Proc, sock: Path) -> None:
    check_resumes(lambda: _source(dataserver, sock), STEPS, _rows, at=[2, 3])
    source = _source(dataserver, sock)
    read(source, _rows, 1)
    assert source.name == ("daemon" if sock.name == "daemon.sock" else "dataserver")
    source.close()


@pytest.mark.parametrize("sock", ["dataserver"], indirect=True)
def test_the_generation_check_resumes_across_a_generation_it_learns_of(dataserver: Proc, sock: Path) -> None:
    _new_generation(dataserver, 4)  # the loader knows only the first: it asks again at step 4
    check_resumes(lambda: GenerationCheck(_source(dataserver, sock), JobPlan((0,))), STEPS, _rows, at=[4, 5])
    check = GenerationCheck(_source(dataserver, sock), JobPlan((0,)))
    assert [gen for _, gen, _ in read(check, _rows)] == [0] * 4 + [4] * 4 and check.plan == JobPlan((0, 4))


@pytest.mark.parametrize("sock", ["dataserver"], indirect=True)
def test_a_step_read_ahead_before_a_new_generation_is_read_again(dataserver: Proc, sock: Path) -> None:
    """The data server plans a step when it is asked for, but the source asks for several at once:
    steps it read ahead before an elastic change are asked for again."""
    source = _source(dataserver, sock, window=STEPS)
    assert source.next().step == 0  # steps 1-7 read ahead under the first plan
    _new_generation(dataserver, 4, replan_served=True)
    check = GenerationCheck(source, job_plan(source.job_info()))
    rest = read(check, _rows)
    assert [(step, gen) for step, gen, _ in rest] == [(s, 0 if s < 4 else 4) for s in range(1, STEPS)]
    direct = GenerationCheck(_source(dataserver, sock), JobPlan((0, 4)))
    assert read(direct, _rows)[1:] == rest
    source.close()


@pytest.mark.parametrize("sock", ["daemon", "dataserver"], indirect=True)
def test_the_look_ahead_resumes(dataserver: Proc, sock: Path) -> None:
    def make() -> LookAhead:
        return LookAhead(_source(dataserver, sock), what="job 'j1' dp_rank 1", thread_name="test-look-ahead", timeout_s=30)

    check_resumes(make, STEPS, _rows, at=[2, 5], settle=lambda part: time.sleep(0.2))  # its read of the next step done


@pytest.mark.parametrize(
    "where",
    [
        "host",
        pytest.param("pinned", marks=pytest.mark.skipif(not cuda_present(), reason="pinning needs CUDA")),
        pytest.param("cuda", marks=pytest.mark.skipif(not cuda_present(), reason="needs a CUDA device")),
    ],
)
@pytest.mark.parametrize("sock", ["daemon"], indirect=True)
def test_placement_resumes(dataserver: Proc, sock: Path, where: str) -> None:
    device = torch.device("cuda", 0) if where == "cuda" else None

    def tensors(item: Fetched) -> tuple[int, list[int], str, bool]:
        batch = item.tensors()
        tokens = batch["tokens"]
        return item.step, batch["_sample_index"].tolist(), tokens.device.type, tokens.is_cuda or tokens.is_pinned()

    check_resumes(lambda: Placement(_source(dataserver, sock), device, pin_memory=where == "pinned"), STEPS, tensors)
    placed = Placement(_source(dataserver, sock), device, pin_memory=where == "pinned")
    _, _, device_type, staged = tensors(placed.next())
    assert (device_type, staged) == ("cuda" if where == "cuda" else "cpu", where != "host")
    placed.close()


class _Tensors(Stage[dict[str, Any]]):
    """Each step as its tensors (what the loader hands the split)."""

    def next(self) -> dict[str, Any]:
        batch: dict[str, Any] = self.upstream.next().tensors()
        return batch


@pytest.mark.parametrize("sock", ["daemon"], indirect=True)
def test_the_micro_batch_split_resumes_inside_a_step(dataserver: Proc, sock: Path) -> None:
    def make() -> MicroBatches:
        return MicroBatches(_Tensors(_source(dataserver, sock)), 3)

    def rows(part: dict[str, Any]) -> list[int]:
        return list(part["_sample_index"].tolist())

    check_resumes(make, 3 * STEPS, rows, at=[3, 4, 5, 10])
    split = make()
    parts = read(split, rows, 4)
    assert [len(p) for p in parts] == [2, 3, 3, 2] and split.state_dict() == {"next_step": 1, "micro_batch": 1}
    with pytest.raises(ValueError, match="micro_batch=3 is not a part"):
        split.reset({"next_step": 1, "micro_batch": 3})
    split.close()


class _Counting(Part[int]):
    """0, 1, ... n - 1; ``state_dict`` off by ``skew`` (a planted bug)."""

    def __init__(self, n: int, skew: int = 0) -> None:
        self.n, self.skew, self.at = n, skew, 0

    def next(self) -> int:
        if self.at >= self.n:
            raise StopIteration
        self.at += 1
        return self.at - 1

    def state_dict(self) -> State:
        return {"next_step": self.at + self.skew}

    def reset(self, state: State) -> None:
        self.at = state["next_step"]


@pytest.mark.parametrize(("make", "fails"), [(lambda: _Counting(6), False), (lambda: _Counting(6, skew=1), True)])
def test_the_resume_check_finds_a_part_that_resumes_elsewhere(make: Callable[[], Part[int]], fails: bool) -> None:
    if fails:
        with pytest.raises(AssertionError, match="reset with the state after 0 items"):
            check_resumes(make, 6)
    else:
        check_resumes(make, 6)
