"""What a role keeps (``statestore.retention``): two copies of its shard on its node and two on
its ring successor when saves are settled, three each when not, and a node loss still costs at
most the step in flight — with real daemons on loopback, a real node loss (daemon SIGKILLed,
its shared memory wiped)."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from ffplane_harness.local_cluster import LocalCluster
from tests._servers import Proc, until
from tests.statestore.conftest import daemon_state, start_ring
from trainer_client import Checkpointer, Layout
from trainer_client.checkpointer import settle_all

ROLES = ("dp0-pp0-tp0", "dp1-pp0-tp0")


def _state(step: int, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return {"w": torch.randn(256, 129, generator=g), "step": step}


def _pair(c: LocalCluster) -> list[Checkpointer]:
    """Rank 0 saves on n0, rank 1 on n1 (each the other's ring successor); private state each."""
    c.until_successor(0, "n1")
    c.until_successor(1, "n0")
    return [Checkpointer("job", Layout(dp=2, dp_rank=r), socket_path=c.socket(r), private_keys=("w", "step")) for r in (0, 1)]


def _held(c: LocalCluster, role: str, step: int) -> list[str]:
    assert c.dataserver is not None
    status = httpx.get(f"{c.dataserver.url}/v1/jobs/job/status").json()
    return sorted(status["shard_locations"].get(role, {}).get(str(step), []))


def _lose_n1_and_restore(c: LocalCluster, expect: int) -> None:
    """n1 (rank 1's node) is lost; rank 1 restarts on a replacement n2, rank 0 on n0: both
    restore ``expect``, bitwise."""
    c.lose_node(1)
    assert c.dataserver is not None
    url = c.dataserver.url
    until(lambda: "n1" in httpx.get(f"{url}/v1/jobs/job/status").json()["dead"], what="n1 declared dead")
    c.start_daemon("--gate-chunk-kb", "64", index=2, budget_mb=64)
    for rank, node in ((0, 0), (1, 2)):
        ck = Checkpointer("job", Layout(dp=2, dp_rank=rank), socket_path=c.socket(node), private_keys=("w", "step"))
        got = ck.restore()
        ck.close()
        assert got is not None and got.step == expect, (rank, got and got.step)
        assert torch.equal(got.state["w"], _state(expect, rank)["w"])


def test_settled_saves_keep_two_copies_a_side_and_a_role_a_step_behind_restores_the_common_step(cluster: LocalCluster) -> None:
    """Rank 1 lags rank 0 by a save when its node is lost: n0 holds rank 0's steps 3 and 4 and
    rank 1's replicas of 2 and 3 (two files each, 4x a shard between the two nodes), and the job
    restores step 3 — the case three versions on a node and two replicas used to guard."""
    start_ring(cluster, 2)
    ranks = _pair(cluster)
    for step in (1, 2, 3):
        settle_all()  # before the step's collective, as the DDP comm hook does
        for r, ck in enumerate(ranks):
            ck.save(step, _state(step, r))
    settle_all()
    ranks[0].save(4, _state(4, 0))  # rank 1 has not saved step 4 when its node goes
    settle_all()
    until(lambda: _held(cluster, ROLES[0], 4) == ["n0", "n1"] and _held(cluster, ROLES[1], 3) == ["n0", "n1"], what="replicas")
    n0 = daemon_state(cluster, 0)
    (role,) = n0["roles"]
    assert role["slots"] == 2 and [v["step"] for v in role["versions"]] == [4, 3] and role["memory"]["settled"] is True
    assert "one node loss; at most 1 lost step" in role["memory"]["survives"]
    assert role["memory"]["multiple"] <= 4.0 * role["slot_bytes"] / role["razored_bytes"] + 1e-3
    (replica,) = n0["replica_memory"]
    assert replica["role"] == ROLES[1] and replica["files"] == 2
    assert sorted(r["step"] for r in n0["replicas"]) == [2, 3]
    for ck in ranks:
        ck.close()
    _lose_n1_and_restore(cluster, 3)


def test_unsettled_saves_keep_a_third_copy_a_side_and_still_restore_the_common_step(cluster: LocalCluster) -> None:
    """Saves nobody settled (no comm hook, no ``settle_all``): a role only knows its own last save
    is answered, another may be a save behind, so each side keeps three copies; the daemon says
    why once, and a node loss with rank 1 behind restores the step both have."""
    start_ring(cluster, 2)
    ranks = _pair(cluster)
    for step in (1, 2, 3):
        for r, ck in enumerate(ranks):
            ck.save(step, _state(step, r))
    ranks[0].save(4, _state(4, 0))
    for ck in ranks:
        ck.wait()
    until(lambda: _held(cluster, ROLES[0], 4) == ["n0", "n1"] and _held(cluster, ROLES[1], 3) == ["n0", "n1"], what="replicas")
    n0 = daemon_state(cluster, 0)
    (role,) = n0["roles"]
    assert role["slots"] == 3 and [v["step"] for v in role["versions"]] == [4, 3, 2] and role["memory"]["settled"] is False
    assert "at most 2 lost steps (saves not settled)" in role["memory"]["survives"]
    (replica,) = n0["replica_memory"]
    assert replica["files"] == 3 and sorted(r["step"] for r in n0["replicas"]) == [1, 2, 3]
    assert "a role keeps one slot more than --versions" in cluster.daemons[0].log()
    for ck in ranks:
        ck.close()
    _lose_n1_and_restore(cluster, 3)


def test_a_larger_versions_budget_is_kept_and_shown(cluster: LocalCluster) -> None:
    start_ring(cluster, 2, "--versions", "3")
    cluster.until_successor(0, "n1")
    ck = Checkpointer("job", socket_path=cluster.socket(0))  # one role: every save is settled
    for step in range(1, 6):
        ck.save(step, _state(step, 0))
    ck.close()
    until(lambda: _held(cluster, ROLES[0], 5) == ["n0", "n1"], what="step 5 replicated")
    n0 = daemon_state(cluster, 0)
    (role,) = n0["roles"]
    assert n0["versions"] == 3 and role["slots"] == 3 and [v["step"] for v in role["versions"]] == [5, 4, 3]
    until(lambda: daemon_state(cluster, 1)["replica_memory"][0]["files"] == 3, what="three replica files on n1")


@pytest.mark.parametrize(
    "flag, says",
    [("--versions", "--versions 1 cannot survive a node loss"), ("--parity-k", "--parity-k 1 is a whole replica")],
)
def test_a_budget_that_cannot_keep_its_bound_is_refused_in_a_line(flag: str, says: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "statestore", "serve", "--dataserver", "http://127.0.0.1:9", flag, "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert says in line


def test_a_save_into_a_slot_reserved_for_a_settled_save_survives_a_daemon_restart(
    start_daemon: Callable[..., Proc], shm_root: Path
) -> None:
    """Step 1's slot comes with step 2's commit reply, still holding step 1 (only a settled save
    may write it). The daemon is SIGKILLed and restarted before step 3 is copied there: the new
    daemon, which never handed that slot out, adopts it for the settled save, and step 1 gives
    way to it."""
    daemon = start_daemon()
    sock = shm_root / "daemon.sock"
    ck = Checkpointer("job", socket_path=sock)  # one role: its saves are settled
    for step in (1, 2):
        ck.save(step, _state(step, 0))
    ck.wait()
    role = _role(daemon)
    assert role["reserved"] == 1 and [v["step"] for v in role["versions"]] == [2, 1]  # the reserved slot holds step 1
    daemon.kill(signal.SIGKILL)
    daemon = start_daemon()
    ck.save(3, _state(3, 0))  # into the slot reserved by the daemon that died, committed to the new one
    ck.wait()
    ck.close()
    role = _role(daemon)
    assert role["slots"] == 2 and [v["step"] for v in role["versions"]] == [3, 2]
    got = Checkpointer("job", socket_path=sock).restore()
    assert got is not None and got.step == 3 and torch.equal(got.state["w"], _state(3, 0)["w"])


def _role(daemon: Proc) -> dict[str, Any]:
    (role,) = httpx.get(daemon.url + "/v1/state").json()["roles"]
    return role
