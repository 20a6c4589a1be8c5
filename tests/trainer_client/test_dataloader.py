from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests._servers import TOKEN, Proc, until
from tests.conftest import create_job
from trainer_client import DataLoader, NotFoundError, StateError, TransportError

JOB_STEPS = -(-3 * 300 // 16)  # three epochs of 300 samples, dp=2 x batch 8 per step


def _read_all(loader: DataLoader) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in b.items()} for b in loader]


def test_two_ranks_exactly_once_and_deterministic(dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    create_job(dataserver, max_steps=JOB_STEPS)
    start_daemon()
    sock = shm_root / "daemon.sock"
    runs = [[_read_all(DataLoader("j1", r, dataserver=dataserver.url, token=TOKEN, socket_path=sock)) for r in range(2)] for _ in range(2)]
    # determinism: a second read of the whole job is byte-identical, per rank and step
    for a, b in zip(runs[0], runs[1]):
        assert len(a) == len(b) == JOB_STEPS
        assert all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(a, b))
    # exactly once: the steps of each epoch, over both ranks, hold every sample once
    stream = np.concatenate(
        [np.concatenate([runs[0][0][s]["_sample_index"], runs[0][1][s]["_sample_index"]]) for s in range(len(runs[0][0]))]
    )
    for epoch in range(3):
        assert Counter(stream[epoch * 300 : (epoch + 1) * 300].tolist()) == Counter(range(300))
    # the bytes are the dataset's: token 0 of a row is its index (see conftest)
    assert torch.equal(runs[0][1][5]["tokens"][:, 0], runs[0][1][5]["_sample_index"])


def test_zero_copy_view_is_private_and_fallback_matches(dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    create_job(dataserver)
    start_daemon()
    cached = DataLoader("j1", 0, dataserver=dataserver.url, token=TOKEN, socket_path=shm_root / "daemon.sock", end_step=4)
    batches = list(cached)
    assert cached.source == "daemon"
    original = batches[3]["tokens"].clone()
    batches[3]["tokens"].zero_()  # training code scribbling on its batch must not reach the cache
    again = DataLoader("j1", 0, dataserver=dataserver.url, token=TOKEN, socket_path=shm_root / "daemon.sock", start_step=3, end_step=4)
    assert torch.equal(next(iter(again))["tokens"], original)
    direct = DataLoader("j1", 0, dataserver=dataserver.url, token=TOKEN, socket_path=shm_root / "absent.sock", start_step=3, end_step=4)
    (b,) = list(direct)
    assert direct.source == "dataserver"
    assert torch.equal(b["tokens"], original)


def test_binary_samples_and_transform(dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    create_job(dataserver, name="img", dataset="images", dp=1, batch_per_rank=20, max_steps=5)
    start_daemon()

    def decode(batch: dict) -> tuple[list[int], torch.Tensor]:
        return [int.from_bytes(bytes(m[:4]), "little") for m in batch["image"]], batch["label"]

    loader = DataLoader("img", 0, dataserver=dataserver.url, token=TOKEN, socket_path=shm_root / "daemon.sock", transform=decode)
    out = list(loader)
    assert len(out) == 5
    for ids, labels in out:
        assert labels.tolist() == [i % 10 for i in ids]


def test_state_dict_round_trip_and_errors(dataserver: Proc) -> None:
    create_job(dataserver)
    loader = DataLoader("j1", 1, dataserver=dataserver.url, token=TOKEN, socket_path="/nonexistent.sock")
    it = iter(loader)
    for _ in range(7):
        next(it)
    state = loader.state_dict()
    assert state == {"kind": "ffplane.DataLoader", "job": "j1", "dp_rank": 1, "next_step": 7}
    resumed = DataLoader("j1", 1, dataserver=dataserver.url, token=TOKEN, socket_path="/nonexistent.sock")
    resumed.load_state_dict(state)
    assert torch.equal(next(iter(resumed))["tokens"], next(it)["tokens"])
    with pytest.raises(Exception, match="state is for job 'j1' dp_rank 1"):
        DataLoader("j1", 0, dataserver=dataserver.url, token=TOKEN).load_state_dict(state)
    with pytest.raises(NotFoundError, match="unknown job 'nope'"):
        DataLoader("nope", 0, dataserver=dataserver.url, token=TOKEN)
    with pytest.raises(TransportError, match="no statestore daemon"):
        next(iter(DataLoader("j1", 0, socket_path="/nonexistent.sock", end_step=1, reconnect_s=0)))


def test_nanogpt_loop_resumes_at_the_batch_after_the_saved_step_and_micro_batches_split_each_step(
    dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path
) -> None:
    """nanoGPT takes the next batch before optimizer.step(); the position saved with step s then
    already pointed past s + 1 and the resumed run silently skipped a batch. Now the position is
    bound to the saved step. Gradient accumulation: a step's batch comes as k micro-batches."""
    from trainer_client import Checkpointer

    create_job(dataserver, max_steps=8)
    start_daemon()
    sock = shm_root / "daemon.sock"

    def loader(**kw: Any) -> DataLoader:
        return DataLoader("j1", 0, dataserver=dataserver.url, token=TOKEN, socket_path=sock, **kw)

    whole = [b["tokens"].clone() for b in loader()]
    ckpt = Checkpointer("j1", socket_path=sock)
    accumulating = loader(micro_batches=2)
    it = iter(accumulating)
    first = next(it)  # nanoGPT: the first batch before the loop
    seen: list[torch.Tensor] = []
    for step in range(3):
        for _micro in range(2):
            seen.append(first["tokens"].clone())
            first = next(it)  # the next micro-batch — at the last one, the next step's — before optimizer.step()
        ckpt.save(step, {"w": torch.zeros(2), "loader": accumulating.state_dict()})
    ckpt.wait()
    assert torch.equal(torch.cat(seen[:2]), whole[0]) and torch.equal(torch.cat(seen[4:6]), whole[2])  # 2 micro-batches per step

    restored = ckpt.restore()
    assert restored is not None and restored.step == 2 and restored.state["loader"]["next_step"] == 3  # not 4: bound to the step
    resumed = loader()
    resumed.load_state_dict(restored.state["loader"])
    assert torch.equal(next(iter(resumed))["tokens"], whole[3])
    with pytest.raises(StateError, match=r"DataLoader at next_step=9 saved with step 3; it must be at 4"):
        ckpt.save(3, {"loader": {**restored.state["loader"], "next_step": 9}})
    ckpt.close()


def _reader(out: Path, dataserver: Proc, sock: Path, rank: int = 0, *args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "FFPLANE_DATASERVER": dataserver.url, "FFPLANE_TOKEN": TOKEN, "FFPLANE_DAEMON_SOCKET": str(sock)}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.trainer_client._reader_worker", "j1", str(rank), str(out), *args],
        env=env,
        cwd=Path(__file__).parents[2],
    )


def _steps(out: Path) -> dict[int, set[str]]:
    seen: dict[int, set[str]] = {}
    for line in (out / "steps.txt").read_text().splitlines():
        step, digest, _ = line.split()
        seen.setdefault(int(step), set()).add(digest)
    return seen


def test_reader_sigkilled_mid_epoch_resumes_byte_identical(
    tmp_path: Path, dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path
) -> None:
    create_job(dataserver, max_steps=40)
    start_daemon()
    sock = shm_root / "daemon.sock"
    ref, crashy = tmp_path / "ref", tmp_path / "crashy"
    ref.mkdir(), crashy.mkdir()
    p = _reader(ref, dataserver, sock)
    try:
        assert p.wait(timeout=120) == 0
        expected = _steps(ref)
        kills = 0
        while True:
            # a step that computes: a reader of cached steps alone finished before the kill landed
            p = _reader(crashy, dataserver, sock, 0, "--step-s", "0.01")
            lines = (crashy / "steps.txt").read_text().count("\n") if (crashy / "steps.txt").exists() else 0
            target = lines + 7 + kills  # different offsets each time
            deadline = time.monotonic() + 60
            while p.poll() is None and time.monotonic() < deadline:
                if (crashy / "steps.txt").exists() and (crashy / "steps.txt").read_text().count("\n") >= target:
                    os.kill(p.pid, signal.SIGKILL)
                    kills += 1
                    break
                time.sleep(0.005)
            p.wait(timeout=30)
            if p.returncode == 0:
                break
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert kills >= 3
    got = _steps(crashy)
    assert sorted(got) == list(range(40))
    assert all(got[s] == expected[s] and len(expected[s]) == 1 for s in got)


def test_daemon_sigkilled_restarts_and_reattaches_without_refetch(
    dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path
) -> None:
    from ffplane_contract.control import Get, Open
    from trainer_client._daemon_client import DaemonClient

    create_job(dataserver)
    daemon = start_daemon("--window", "6")
    sock = shm_root / "daemon.sock"
    client = DaemonClient(sock, 30)
    client.call(Open("j1", 0, TOKEN))
    client.call(Get(10))
    deadline = time.monotonic() + 30
    files = sorted((shm_root / "j1" / "data" / "0").glob("*.arrow"))
    while len(files) < 6 and time.monotonic() < deadline:  # the window 10..15 prefetched
        time.sleep(0.05)
        files = sorted((shm_root / "j1" / "data" / "0").glob("*.arrow"))
    inodes = {f.name: f.stat().st_ino for f in files}
    client.close()
    daemon.kill(signal.SIGKILL)
    (shm_root / "j1" / "data" / "0" / "000000000099.arrow.tmp-424242").write_bytes(b"half-written")
    (shm_root / "j1" / "data" / "0" / "000000000098.arrow").write_bytes(b"never indexed")

    restarted = start_daemon("--window", "6")
    client = DaemonClient(sock, 30)
    client.call(Open("j1", 0, TOKEN))
    for name in inodes:
        reply = client.call(Get(int(name.split(".")[0])))
        assert reply.hit, f"{name} was refetched after the restart"
        assert (shm_root / reply.path).stat().st_ino == inodes[name]
    client.close()
    left = {p.name for p in (shm_root / "j1" / "data" / "0").iterdir()}
    assert "000000000099.arrow.tmp-424242" not in left and "000000000098.arrow" not in left
    assert "reattached_steps" in restarted.log()


def test_replies_to_requests_sent_ahead_are_read_as_their_own_type(
    dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path
) -> None:
    """A reader sends ``Get`` without waiting; the next call reads those replies first, each as
    the answer to its own request (read as the call's type, an ``Open`` after them failed)."""
    from ffplane_contract.control import Get, Open, OpenReply
    from trainer_client._daemon_client import DaemonClient

    create_job(dataserver)
    start_daemon()
    client = DaemonClient(shm_root / "daemon.sock", 30)
    try:
        client.call(Open("j1", 0, TOKEN))
        for step in (0, 1, 2):
            client.send(Get(step))
        reopened = client.call(Open("j1", 1, TOKEN))
        assert isinstance(reopened, OpenReply) and reopened.steps == "j1/data/1"
        assert client.call(Get(0)).path.startswith("j1/data/1/")
    finally:
        client.close()


def test_one_copy_per_node_for_many_readers(dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    import httpx

    create_job(dataserver, max_steps=12)
    daemon = start_daemon()
    loaders = [DataLoader("j1", 1, dataserver=dataserver.url, token=TOKEN, socket_path=shm_root / "daemon.sock") for _ in range(3)]
    outs = [list(zip(*[iter(lo) for lo in loaders]))]  # three tp-ranks of one dp rank, in lock step
    assert all(torch.equal(a["tokens"], b["tokens"]) for triple in outs[0] for a, b in zip(triple, triple[1:]))
    (stream,) = httpx.get(daemon.url + "/v1/cache").json()["streams"]
    assert stream["fetched"] == 12  # each step fetched once, not once per reader
    metrics = httpx.get(daemon.url + "/metrics").text
    assert 'ffplane_cache_hits_total{dp_rank="1",job="j1"}' in metrics


def test_a_new_generation_replaces_batches_the_node_cached_under_the_old_plan(
    dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's check (it owns the cache): the loader over it asks the data server nothing
    per step, so were a stale step served, the loader would hand it out."""
    import httpx

    from dataserver import Generation, Planner
    from trainer_client._sources import HttpSource

    create_job(dataserver, max_steps=30)
    start_daemon("--window", "8")
    sock = shm_root / "daemon.sock"
    first = DataLoader("j1", 0, dataserver=dataserver.url, token=TOKEN, socket_path=sock)
    it = iter(first)
    for _ in range(3):
        next(it)
    deadline = time.monotonic() + 30  # the daemon has prefetched steps 3.. under the old plan
    while len(list((shm_root / "j1" / "data" / "0").glob("*.arrow"))) < 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    first.close()
    # an elastic restart from step 3 with another layout
    r = httpx.post(
        dataserver.url + "/v1/jobs/j1/generations",
        json={"start_step": 3, "dp": 3, "batch_per_rank": 5, "replan_served": True},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert r.status_code == 200, r.text
    plan = Planner(300, 5, [Generation(0, 2, 8), Generation(3, 3, 5)])
    asked: list[str] = []
    for name in ("job_info", "get"):
        real = getattr(HttpSource, name)
        monkeypatch.setattr(HttpSource, name, lambda self, *a, _f=real, _n=name: asked.append(_n) or _f(self, *a))
    resumed = DataLoader("j1", 0, dataserver=dataserver.url, token=TOKEN, socket_path=sock, start_step=3, end_step=9)
    got = [b["_sample_index"].tolist() for b in resumed]
    assert resumed.source == "daemon"
    assert got == [plan.plan(0, s).indices.tolist() for s in range(3, 9)]
    assert asked == ["job_info"]  # once, for the job's end: no step read or checked over HTTP


def _cached(daemon: Proc, steps: int) -> bool:
    import httpx

    streams = httpx.get(daemon.url + "/v1/cache").json()["streams"]
    return bool(streams) and len(streams[0]["steps"]) >= steps


def test_cached_steps_are_read_while_the_daemon_is_paused(dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    """Published steps are mapped without waiting for the daemon's answer (it is read later):
    a daemon stalled by a GC pause or a busy core does not stall training on data it holds."""
    import httpx

    create_job(dataserver, max_steps=12)
    daemon = start_daemon("--window", "12")
    loader = DataLoader("j1", 0, dataserver=dataserver.url, token=TOKEN, socket_path=shm_root / "daemon.sock", timeout_s=5)
    batches = iter(loader)
    first = next(batches)["tokens"].clone()
    until(lambda: _cached(daemon, 12), what="12 steps cached")
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        rest = [b["tokens"].clone() for b in batches]  # an answer-per-step reader times out here
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    direct = DataLoader("j1", 0, dataserver=dataserver.url, token=TOKEN, socket_path=shm_root / "absent.sock")
    assert all(torch.equal(a, b["tokens"]) for a, b in zip([first, *rest], direct, strict=True))
    # and the daemon still saw every position: each step counted as a hit or a miss
    until(
        lambda: sum(httpx.get(daemon.url + "/v1/cache").json()["streams"][0][k] for k in ("hits", "misses")) == 12, what="12 reads counted"
    )
    loader.close()


def _pmd_mapped_kib(path: Path) -> int:
    """KiB of ``path`` this process maps with 2 MiB page-table entries, after reading it all."""
    import mmap

    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    try:
        sum(mm[i] for i in range(0, len(mm), 4096))
        lines = Path("/proc/self/smaps").read_text().splitlines()
        at = next(i for i, line in enumerate(lines) if line.endswith(str(path)))
        return sum(int(line.split()[1]) for line in lines[at + 1 : at + 30] if line.startswith(("ShmemPmdMapped:", "FilePmdMapped:")))
    finally:
        mm.close()


def test_cached_steps_use_huge_pages_on_a_huge_tmpfs(
    tmp_path: Path, data_dir: Path, dataserver: Proc, start_daemon: Callable[..., Proc], huge_tmpfs: Path
) -> None:
    import httpx

    from dataserver.ingest import IngestConfig, ingest
    from tests.conftest import write_token_parquet

    write_token_parquet(tmp_path / "wide.parquet", 64, seq_len=16384)  # 128 KiB rows
    ingest(IngestConfig([tmp_path / "wide.parquet"], data_dir / "wide", progress=False))
    create_job(dataserver, dataset="wide", dp=1, batch_per_rank=24, max_steps=4)  # 3 MiB steps
    root = huge_tmpfs / "ffplane"
    daemon = start_daemon("--budget-mb", "48", root=root)
    assert httpx.get(daemon.url + "/v1/cache").json()["huge_pages"] == "within_size"
    loader = DataLoader("j1", 0, dataserver=dataserver.url, token=TOKEN, socket_path=root / "daemon.sock")
    assert len([b["tokens"].sum() for b in loader]) == 4
    step = root / "j1" / "data" / "0" / "000000000003.arrow"  # the last two read are kept
    assert _pmd_mapped_kib(step) >= 2048, "the cached step is on 4 KiB pages: was it written without its final size first?"
    loader.close()


def test_a_reader_of_cached_steps_keeps_the_daemon_reading(dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    """A reader whose every step is already cached only sends ``get``s: their replies must not
    pile up unread, or the daemon's writer blocks on the full socket and the reader's cursor
    (which drives prefetch and eviction) freezes part-way."""
    import httpx

    steps = 1500
    create_job(dataserver, max_steps=steps)
    daemon = start_daemon("--window", str(steps))
    loader = DataLoader("j1", 0, dataserver=dataserver.url, token=TOKEN, socket_path=shm_root / "daemon.sock", timeout_s=30)
    batches = iter(loader)
    next(batches)
    until(lambda: _cached(daemon, steps), timeout_s=120, what=f"{steps} steps cached")
    for _ in batches:
        pass
    assert loader.source == "daemon"

    def cursor() -> list[int]:
        return list(httpx.get(daemon.url + "/v1/cache").json()["streams"][0]["reader_steps"])

    until(lambda: cursor() == [steps - 1], timeout_s=10, what=f"the daemon to see the reader at step {steps - 1} (it is at {cursor()})")
    loader.close()


def _mapped_steps(steps_dir: Path) -> set[int]:
    """Steps of ``steps_dir`` this process maps now (evicted ones show as "(deleted)")."""
    out = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split(maxsplit=5)[-1]
        if path.startswith(str(steps_dir)) and path.split()[0].endswith(".arrow"):
            out.add(int(Path(path.split()[0]).stem))
    return out


def test_the_loader_unmaps_steps_two_behind_not_the_training_thread_at_once(
    dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path
) -> None:
    """A step's mapping goes when its last reference does. The loader holds each step it hands
    out until its look-ahead thread drops it two steps later, so the unmap (a TLB shootdown)
    happens there, not in the training thread as it lets go of the previous batch; a batch the
    training code keeps stays valid whatever the loader holds."""
    create_job(dataserver, max_steps=12)
    start_daemon("--window", "12")
    loader = DataLoader("j1", 0, dataserver=dataserver.url, token=TOKEN, socket_path=shm_root / "daemon.sock")
    steps_dir = shm_root / "j1" / "data" / "0"
    batches = iter(loader)
    kept = next(batches)["tokens"]  # a view into step 0's mapping, kept by the training code
    kept_copy = kept.clone()
    seen = []
    for step in range(1, 12):
        next(batches)  # dropped at once, as a training loop drops each batch
        seen.append((step, _mapped_steps(steps_dir)))
    for step, mapped in seen:
        assert {step - 1, step} <= mapped, f"at step {step}: {sorted(mapped)} (the last two handed out are held)"
        assert not {s for s in mapped if 0 < s < step - 2}, f"at step {step}: {sorted(mapped)} (older ones are released)"
    assert torch.equal(kept, kept_copy)  # step 0 stays mapped for the view that uses it
    loader.close()


def test_steps_of_a_mapped_run_are_read_on_the_training_thread_and_old_files_unmapped_off_it(
    dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step in the run file the loader has mapped is read where it is asked for: handing it to
    the look-ahead thread cost a wake-up, a switch and a wait for the GIL every step. Only a step
    in another file goes to that thread, which also drops the files read before (their unmap)."""
    import threading

    from trainer_client._sources import DaemonSource

    on_thread: dict[int, bool] = {}  # step → read on the look-ahead thread
    real_get = DaemonSource.get

    def get(self: DaemonSource, step: int) -> Any:
        on_thread[step] = threading.current_thread() is not threading.main_thread()
        return real_get(self, step)

    monkeypatch.setattr(DaemonSource, "get", get)
    create_job(dataserver, max_steps=1000)
    start_daemon("--fetch-steps", "16", "--window", "4")
    loader = DataLoader("j1", 0, dataserver=dataserver.url, token=TOKEN, socket_path=shm_root / "daemon.sock", end_step=96)
    steps_dir = shm_root / "j1" / "data" / "0"
    mapped = []  # the files this process maps after each step
    for _ in loader:
        time.sleep(0.005)  # a step that computes: the prefetch keeps a run ahead
        mapped.append(_mapped_steps(steps_dir))
    loader.close()
    assert sorted(on_thread) == list(range(96))
    assert sum(on_thread.values()) <= 96 // 16 + 4, on_thread  # one a file (the first steps may come alone)
    for i in range(1, 96):
        if mapped[i - 1] - mapped[i]:  # a file went between step i-1 and step i: its unmap ran on the
            # look-ahead thread, fetching step i or (started before step i was handed out) step i + 1
            assert on_thread[i] or on_thread.get(i + 1, False), f"step {i}: {sorted(mapped[i - 1])} -> {sorted(mapped[i])}"
    assert max(len(m) for m in mapped) <= 3, mapped  # the file read, the one before it (until the next entry), at most one more


def test_device_is_checked_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="'cpu' or a CUDA device"):
        DataLoader("j1", 0, socket_path="/nonexistent.sock", device="mps")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no CUDA device"):
            DataLoader("j1", 0, socket_path="/nonexistent.sock", device="cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(150)
@pytest.mark.parametrize("root_on", ["shm", "huge_pages"])
def test_batches_arrive_on_the_device_as_the_host_reads_them(
    dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path, root_on: str, request: pytest.FixtureRequest
) -> None:
    """Also with the cache on a huge-page tmpfs (the recommended root): registering a cached
    step's private mapping for the device copies never returned there."""
    create_job(dataserver, max_steps=12)
    root = request.getfixturevalue("huge_tmpfs") / "ffplane" if root_on == "huge_pages" else shm_root
    start_daemon(root=root)
    common = {"dataserver": dataserver.url, "token": TOKEN, "socket_path": root / "daemon.sock"}
    host = _read_all(DataLoader("j1", 1, **common))  # type: ignore[arg-type]
    pinned = DataLoader("j1", 1, pin_memory=True, **common)  # type: ignore[arg-type]
    on_device = [{k: v.clone() for k, v in b.items()} for b in DataLoader("j1", 1, device="cuda", **common)]  # type: ignore[arg-type]
    assert len(on_device) == len(host) == 12
    for h, d in zip(host, on_device):
        assert d["tokens"].is_cuda and torch.equal(d["tokens"].cpu(), h["tokens"])
    first = next(iter(pinned))
    assert first["tokens"].is_pinned()  # a CPU loader's pinned step: the caller's .to(non_blocking) is async
    pinned.close()
