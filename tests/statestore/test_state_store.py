from __future__ import annotations

import os
import shutil
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch

from tests._servers import TOKEN, Proc
from tests.statestore.conftest import SharedNode
from trainer_client import CapacityError, Checkpointer, Layout
from trainer_client.checkpointer import settle_all


def _state(step: int, seed: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    model = {"w": torch.randn(256, 64, generator=g) + step, "b": torch.full((64,), float(step), dtype=torch.bfloat16)}
    return {"model": model, "optim": {"m": model["w"] * 0.5, "count": torch.tensor(step)}, "step": step, "note": f"after {step}"}


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def _save(cks: list[Checkpointer], steps: tuple[int, ...] | range) -> None:
    """Every checkpointer saves every step (the test state of that step), then commits and closes."""
    for step in steps:
        for ck in cks:
            ck.save(step, _state(step))
    for ck in cks:
        ck.close()


def _pair(sock: Path, job: str = "job", **kw: object) -> list[Checkpointer]:
    return [Checkpointer(job, Layout(dp=2, dp_rank=r), socket_path=sock, **kw) for r in range(2)]  # type: ignore[arg-type]


def test_razor_splits_replicated_state_and_restore_reassembles(shared_node: SharedNode, job: str) -> None:
    cks = _pair(shared_node.sock, job)
    assert cks[0].restore() is None  # a fresh job
    _save(cks, range(4))
    roles = {r["role"]: r for r in shared_node.roles(job)}
    unique = roles["dp0-pp0-tp0"]["unique_bytes"]
    assert roles["dp0-pp0-tp0"]["razored_bytes"] + roles["dp1-pp0-tp0"]["razored_bytes"] == unique
    assert abs(roles["dp0-pp0-tp0"]["razored_bytes"] - unique / 2) <= 64
    assert [v["step"] for v in roles["dp1-pp0-tp0"]["versions"]] == [3, 2, 1]  # three newest kept
    restored = Checkpointer(job, Layout(dp=2, dp_rank=1), socket_path=shared_node.sock).restore()
    assert restored is not None and restored.step == 3 and restored.source == "memory"
    assert _equal(restored.state, _state(3))


def test_private_state_is_saved_whole_by_its_owner(shared_node: SharedNode, job: str) -> None:
    sock = shared_node.sock
    cks = [Checkpointer(job, Layout(dp=2, dp_rank=r), private_keys=("optim",), socket_path=sock) for r in range(2)]
    for r, ck in enumerate(cks):
        st = _state(4)
        st["optim"] = {"shard": torch.full((1000,), float(r))}  # ZeRO: each rank owns different optimizer state
        ck.save(4, st)
        ck.close()
    for r in range(2):
        got = Checkpointer(job, Layout(dp=2, dp_rank=r), private_keys=("optim",), socket_path=sock).restore()
        assert got is not None and torch.equal(got.state["optim"]["shard"], torch.full((1000,), float(r)))
        assert _equal(got.state["model"], _state(4)["model"])


def test_restore_into_existing_tensors(shared_node: SharedNode, job: str) -> None:
    ck = Checkpointer(job, socket_path=shared_node.sock)
    ck.save(7, _state(7))
    ck.close()
    live = _state(0)
    ptrs = [live["model"]["w"].data_ptr(), live["optim"]["m"].data_ptr()]  # type: ignore[index]
    got = Checkpointer(job, socket_path=shared_node.sock).restore(into=live)
    assert got is not None and got.state is live and got.step == 7
    assert [live["model"]["w"].data_ptr(), live["optim"]["m"].data_ptr()] == ptrs  # type: ignore[index]
    assert _equal(live, _state(7))


def test_corrupt_slot_falls_back_to_the_older_version_for_every_role(shared_node: SharedNode, job: str) -> None:
    sock = shared_node.sock
    _save(_pair(sock, job), (10, 11))
    newest = next(r for r in shared_node.roles(job) if r["role"] == "dp1-pp0-tp0")["versions"][0]
    assert newest["step"] == 11
    with open(shared_node.root / newest["slot"], "r+b") as f:  # flip bytes in the middle of the shard
        f.seek(newest["nbytes"] // 2)
        f.write(b"\xff" * 16)
    for r in range(2):  # invariant 3: both roles restore the same (older) step
        got = Checkpointer(job, Layout(dp=2, dp_rank=r), socket_path=sock).restore()
        assert got is not None and got.step == 10 and _equal(got.state, _state(10))


def test_all_memory_copies_corrupt_uses_the_durable_tier(tmp_path: Path, start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    daemon = start_daemon("--durable-dir", str(tmp_path / "durable"), "--durable-every", "2")
    sock = shm_root / "daemon.sock"
    _save([Checkpointer("job", socket_path=sock)], range(4))  # steps 0 and 2 go to the durable tier
    for v in next(iter(httpx.get(daemon.url + "/v1/state").json()["roles"]))["versions"]:
        (shm_root / v["slot"]).write_bytes(b"\0" * v["nbytes"])  # same size, wrong bytes
    got = Checkpointer("job", socket_path=sock).restore()
    assert got is not None and got.source == "durable" and got.step == 2 and _equal(got.state, _state(2))
    import safetensors.numpy  # readable without ffplane

    shard = safetensors.numpy.load_file(str(tmp_path / "durable" / "job" / f"step-{2:012d}" / "dp0-pp0-tp0.safetensors"))["shard"]
    assert shard.dtype.name == "uint8" and shard.size > 256 * 64 * 4


def test_daemon_sigkilled_and_restarted_serves_every_committed_version(start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    daemon = start_daemon()
    sock = shm_root / "daemon.sock"
    _save(_pair(sock), (20, 21))
    before = httpx.get(daemon.url + "/v1/state").json()["roles"]
    daemon.kill(signal.SIGKILL)
    restarted = start_daemon()
    after = httpx.get(restarted.url + "/v1/state").json()["roles"]
    key = lambda roles: sorted((r["role"], v["step"], v["checksum"]) for r in roles for v in r["versions"])  # noqa: E731
    assert key(after) == key(before) and len(key(after)) == 4
    got = Checkpointer("job", Layout(dp=2, dp_rank=0), socket_path=sock).restore()
    assert got is not None and got.step == 21 and _equal(got.state, _state(21))
    # a live Checkpointer reconnects to the restarted daemon and saves into the reattached slots
    live = Checkpointer("job", Layout(dp=2, dp_rank=0), socket_path=sock)
    live.save(22, _state(22))
    live.wait()
    restarted.kill(signal.SIGKILL)
    third = start_daemon()
    live.save(23, _state(23))
    live.close()
    assert [v["step"] for r in httpx.get(third.url + "/v1/state").json()["roles"] if r["role"] == "dp0-pp0-tp0" for v in r["versions"]] == [
        23,
        22,
        21,
    ]


def test_state_that_cannot_fit_fails_at_the_first_save(start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    start_daemon()  # 256 MiB budget (see conftest)
    ck = Checkpointer("job", socket_path=shm_root / "daemon.sock")
    with pytest.raises(CapacityError, match=r"needs 2 slots x 160.0 MiB .* raise the daemon's --budget-mb"):
        ck.save(0, {"w": torch.zeros(40 << 20)})  # 160 MiB x 2 slots > 256 MiB
    ck.close()
    assert not list((shm_root / "job" / "state").rglob("*.bin")) if (shm_root / "job" / "state").exists() else True


def test_shard_bytes_need_the_token(shared_node: SharedNode, job: str) -> None:
    url = shared_node.daemon.url
    ck = Checkpointer(job, socket_path=shared_node.sock)
    ck.save(1, _state(1))
    ck.close()
    shard = f"{url}/v1/state/{job}/dp0-pp0-tp0/1/shard"
    assert httpx.get(shard).status_code == 401
    r = httpx.get(shard, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and len(r.content) > 0
    import xxhash

    assert xxhash.xxh3_64_hexdigest(r.content) == r.headers["x-ffplane-checksum"]
    assert httpx.get(f"{url}/v1/state/{job}/dp0-pp0-tp0/99/shard", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 404
    assert shared_node.roles(job)[0]["versions"][0]["save_block_s"] > 0
    assert f'ffplane_state_newest_step{{job="{job}",role="dp0-pp0-tp0"}} 1.0' in httpx.get(url + "/metrics").text


def test_restored_tensors_are_owned_unless_a_view_is_asked_for(shared_node: SharedNode, job: str) -> None:
    sock = shared_node.sock
    ck = Checkpointer(job, socket_path=sock)
    ck.save(3, _state(3))
    ck.close()
    owned = Checkpointer(job, socket_path=sock).restore()
    view = Checkpointer(job, socket_path=sock).restore(view=True)
    assert owned is not None and view is not None and _equal(view.state, _state(3))
    (slot,) = [v["slot"] for v in shared_node.roles(job)[0]["versions"]]
    with open(shared_node.root / slot, "r+b") as f:  # the slot is reused by later saves
        f.write(b"\0" * 1024)
    assert _equal(owned.state, _state(3))  # an owned restore never sees slot reuse
    assert not _equal(view.state["model"], _state(3)["model"])  # a view does: documented contract


def test_large_state_copied_by_several_threads_round_trips(shared_node: SharedNode, job: str) -> None:
    g = torch.Generator().manual_seed(3)
    big = {
        "a": torch.randn(3_000_001, generator=g),
        "b": torch.randn(1_234_567, generator=g).to(torch.bfloat16),
        "c": torch.arange(2_000_003),
    }
    cks = [Checkpointer(job, Layout(dp=2, dp_rank=r), socket_path=shared_node.sock, copy_threads=3) for r in range(2)]
    for ck in cks:
        ck.save(1, big)
        ck.close()
    got = Checkpointer(job, Layout(dp=2, dp_rank=1), socket_path=shared_node.sock).restore()
    assert got is not None and _equal(got.state, big)


def test_restore_into_live_parameters(shared_node: SharedNode, job: str) -> None:
    src = torch.nn.Linear(2048, 2048)  # 16 MiB: the multi-threaded copy path
    ck = Checkpointer(job, socket_path=shared_node.sock)
    ck.save(0, {"model": src.state_dict()})
    ck.close()
    dst = torch.nn.Linear(2048, 2048)
    live = {"model": dict(dst.named_parameters())}  # Parameters that require grad
    got = Checkpointer(job, socket_path=shared_node.sock).restore(into=live)
    assert got is not None and torch.equal(dst.weight, src.weight) and dst.weight.requires_grad


def test_three_way_razor_restores_into_and_as_views(shared_node: SharedNode, job: str) -> None:
    sock = shared_node.sock
    state = _state(5)
    for r in range(3):  # dp=3: slice boundaries that are not multiples of any dtype size, unless aligned
        ck = Checkpointer(job, Layout(dp=3, dp_rank=r), socket_path=sock)
        ck.save(5, state)
        ck.close()
    for r in range(3):
        live = _state(0)
        got = Checkpointer(job, Layout(dp=3, dp_rank=r), socket_path=sock).restore(into=live)
        assert got is not None and _equal(live, state)
        view = Checkpointer(job, Layout(dp=3, dp_rank=r), socket_path=sock).restore(view=True)
        assert view is not None and _equal(view.state, state)


def test_a_rewound_run_replaces_the_newer_versions(shared_node: SharedNode, job: str) -> None:
    ck = Checkpointer(job, socket_path=shared_node.sock)
    for step in (204, 205, 206):
        ck.save(step, _state(step))
    ck.save(101, _state(101))  # the job restarted from an older checkpoint under the same name
    ck.save(102, _state(102))
    ck.close()
    assert [v["step"] for v in shared_node.roles(job)[0]["versions"]] == [102, 101]
    got = Checkpointer(job, socket_path=shared_node.sock).restore()
    assert got is not None and got.step == 102 and _equal(got.state, _state(102))


def test_failures_do_not_poison_later_saves_or_restores(
    start_daemon: Callable[..., Proc], shm_root: Path, fail_first_copy: Callable[[], None]
) -> None:
    start_daemon()
    sock = shm_root / "daemon.sock"
    too_big = Checkpointer("ok", Layout(dp=1), socket_path=sock)
    with pytest.raises(CapacityError):
        too_big.save(0, {"w": torch.zeros(40 << 20)})  # a refused allocation leaves no phantom role
    too_big.close()
    ck = Checkpointer("ok", socket_path=sock)
    for step in (1, 2):
        ck.save(step, _state(step))
    ck.wait()
    fail_first_copy()
    with pytest.raises(RuntimeError, match="injected"):
        ck.save(3, _state(3))
    ck.save(3, _state(3))  # the slot begun by the failed save was given back
    ck.close()
    got = Checkpointer("ok", socket_path=sock).restore()
    assert got is not None and got.step == 3 and _equal(got.state, _state(3))


def test_every_copy_corrupt_and_no_durable_tier_is_an_error_not_a_fresh_start(shared_node: SharedNode, job: str) -> None:
    _save([Checkpointer(job, socket_path=shared_node.sock)], (1, 2))
    for v in shared_node.roles(job)[0]["versions"]:
        (shared_node.root / v["slot"]).write_bytes(b"\1" * v["nbytes"])
    from trainer_client import CorruptError

    with pytest.raises(CorruptError, match="failed their checksums"):
        Checkpointer(job, socket_path=shared_node.sock).restore()


def test_a_step_saved_by_a_run_the_job_rewound_from_is_never_mixed_in(shared_node: SharedNode, job: str) -> None:
    sock = shared_node.sock
    ranks = _pair(sock, job)
    for step in (1, 2, 3):
        for ck in ranks:
            ck.save(step, _state(step))
    ranks[0].save(4, _state(4))  # rank 1 dies before its step 4: the job rewinds to 3
    for ck in ranks:
        ck.close()
    ranks = _pair(sock, job)
    assert [ck.restore().step for ck in ranks] == [3, 3]  # type: ignore[union-attr]
    ranks[1].save(4, _state(4, seed=9))  # the new run's step 4; rank 0 dies before its own
    for ck in ranks:
        ck.close()
    # step 4 now exists for both roles, from two different runs: it must not be restored
    got = [Checkpointer(job, Layout(dp=2, dp_rank=r), socket_path=sock).restore() for r in range(2)]
    assert [g.step for g in got if g is not None] == [3, 3] and _equal(got[0].state, _state(3))  # type: ignore[union-attr]


def _versions(daemon: Proc, role: str = "dp0-pp0-tp0") -> dict[str, object]:
    return next(r for r in httpx.get(daemon.url + "/v1/state").json()["roles"] if r["role"] == role)


def test_a_save_while_the_previous_commit_is_unanswered_waits_or_skips(start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    daemon = start_daemon()
    sock = shm_root / "daemon.sock"
    skip = Checkpointer("skip", socket_path=sock, on_busy="skip")
    wait = Checkpointer("wait", socket_path=sock, on_busy="wait")
    for ck in (skip, wait):
        ck.save(1, _state(1))
        ck.wait()
    os.kill(daemon.pid, signal.SIGSTOP)  # the daemon can take commits in, not answer them
    try:
        assert skip.save(2, _state(2)) and wait.save(2, _state(2))  # sent; nothing pending before them
        assert skip.save(3, _state(3)) is False and skip.skipped == 1  # step 2's commit is unanswered
        threading.Timer(0.5, os.kill, (daemon.pid, signal.SIGCONT)).start()
        assert wait.save(3, _state(3))  # blocked until the daemon answered step 2, then saved
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    # skip's step-2 answer may still be on its way (wait only waited for its own): wait for it,
    # then skip saves again
    skip.wait()
    assert skip.save(4, _state(4))
    for ck in (skip, wait):
        ck.close()
    steps = {
        job: [v["step"] for r in httpx.get(daemon.url + "/v1/state").json()["roles"] if r["job"] == job for v in r["versions"]]
        for job in ("skip", "wait")
    }
    assert steps == {"skip": [4, 2], "wait": [3, 2]}  # one role each: settled, two kept


def test_the_next_save_s_slot_comes_with_the_commit_and_is_released_with_the_connection(
    start_daemon: Callable[..., Proc], shm_root: Path
) -> None:
    daemon = start_daemon()
    ck = Checkpointer("job", socket_path=shm_root / "daemon.sock")
    ck.save(1, _state(1))
    ck.wait()
    assert _versions(daemon)["reserved"] == 1  # handed out with step 1's commit reply
    for step in (2, 3, 4, 5):  # four saves round the two slots on reserved slots alone
        ck.save(step, _state(step))
    ck.close()
    role = _versions(daemon)
    assert role["reserved"] == 0 and [v["step"] for v in role["versions"]] == [5, 4] and role["slots"] == 2
    assert len({v["slot"] for v in role["versions"]}) == 2
    replication = httpx.get(daemon.url + "/v1/state").json()["replication"]
    assert replication is None or replication["pending"] == 0  # alone: nothing queued for a successor


def test_a_changed_state_structure_is_committed_whole_and_both_survive_a_daemon_restart(
    start_daemon: Callable[..., Proc], shm_root: Path
) -> None:
    daemon = start_daemon()
    sock = shm_root / "daemon.sock"
    grown = lambda step: {**_state(step), "extra": torch.arange(7) + step}  # noqa: E731
    ck = Checkpointer("job", socket_path=sock)
    ck.save(1, _state(1))
    ck.save(2, _state(2))
    ck.save(3, grown(3))  # new tensors: a new static header, sent with this commit
    ck.close()
    daemon.kill(signal.SIGKILL)
    daemon = start_daemon()  # reattaches the index: per-step trees joined to their static parts
    assert [v["step"] for v in _versions(daemon)["versions"]] == [3, 2]
    got = Checkpointer("job", socket_path=sock).restore()
    assert got is not None and got.step == 3 and _equal(got.state, grown(3))
    newest = _versions(daemon)["versions"][0]
    with open(shm_root / newest["slot"], "r+b") as f:
        f.seek(newest["nbytes"] // 2)
        f.write(b"\xff" * 16)
    got = Checkpointer("job", socket_path=sock).restore()  # step 2, with the structure it had
    assert got is not None and got.step == 2 and _equal(got.state, _state(2))


def test_a_live_checkpointer_carries_on_when_its_daemon_comes_back_empty(start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    """A node's tmpfs wiped under a running job (a replaced node, a reboot of the daemon's pod):
    the save into a slot the old daemon reserved is not committed, and is not an error; the next
    save allocates fresh slots."""
    daemon = start_daemon()
    sock = shm_root / "daemon.sock"
    ck = Checkpointer("job", socket_path=sock)
    for step in (1, 2):
        settle_all()  # settled saves: the next one takes the slot reserved with the last commit
        ck.save(step, _state(step))
    ck.wait()
    settle_all()
    daemon.kill(signal.SIGKILL)
    for child in shm_root.iterdir():  # everything the daemon had: slots, index, socket
        shutil.rmtree(child) if child.is_dir() else child.unlink()
    daemon = start_daemon()
    ck.save(3, _state(3))  # copied into the old reservation; the new daemon never heard of it
    ck.save(4, _state(4))
    ck.close()
    assert [v["step"] for v in _versions(daemon)["versions"]] == [4]
    got = Checkpointer("job", socket_path=sock).restore()
    assert got is not None and got.step == 4 and _equal(got.state, _state(4))


def test_a_header_field_of_ffplanes_own_is_refused_and_the_next_save_goes_on(shared_node: SharedNode, job: str) -> None:
    ck = Checkpointer(job, socket_path=shared_node.sock)
    with pytest.raises(ValueError, match="piece"):
        ck.save(1, _state(1), header={"piece": [0, 0]})  # would have overwritten the shard's slice
    assert ck.save(2, _state(2), header={"mine": {"catalogue": [1, 2]}})
    ck.close()
    got = Checkpointer(job, socket_path=shared_node.sock).restore()
    assert got is not None and got.step == 2 and _equal(got.state, _state(2))
