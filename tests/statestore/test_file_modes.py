"""What a daemon keeps on disk is private to the user it runs as (issue #15, item 12).

Cached batches, state slots, replicas, the LMDB index and the durable tier hold the job's data
and training state: every folder the daemon creates is 0700 and every file 0600. A folder the
operator made (here ``--root``, created by the ``shm_root`` fixture) keeps the mode it was given;
one the daemon has to create (the second node's root, the durable directory and its missing
parent) is 0700 like the rest.
"""

from __future__ import annotations

import os
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests._servers import TOKEN, Proc, until
from tests.conftest import create_job
from trainer_client import Checkpointer, DataLoader, Layout


@pytest.fixture
def fresh_root() -> Iterator[Path]:
    """A tmpfs root that does not exist yet: the daemon creates it."""
    root = Path("/dev/shm") / f"ffplane-test-{uuid.uuid4().hex[:8]}"
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _shared(top: Path) -> list[str]:
    """Everything under ``top`` (and ``top`` itself) that group or others can reach, with its mode."""
    found = []
    for path in [top, *top.rglob("*")]:
        mode = path.lstat().st_mode
        if stat.S_IMODE(mode) & 0o077:
            found.append(f"{path} {stat.filemode(mode)}")
    return found


def test_cache_slots_replicas_index_and_durable_files_are_private(
    tmp_path: Path,
    dataserver: Proc,
    start_daemon: Callable[..., Proc],
    shm_root: Path,
    fresh_root: Path,
) -> None:
    create_job(dataserver, name="j1", dp=1, max_steps=20)
    durable = tmp_path / "tier" / "durable"  # neither exists: the daemon makes both
    primary = start_daemon("--node-id", "a", "--durable-dir", str(durable), "--durable-every", "1")
    successor = start_daemon("--node-id", "b", "--durable-dir", str(durable), root=fresh_root, name="b")
    until(
        lambda: len(httpx.get(f"{dataserver.url}/v1/jobs/j1/status").json()["ring"]) == 2,
        what="both daemons in the ring",
    )

    sock = shm_root / "daemon.sock"
    batches = list(
        DataLoader(
            "j1",
            0,
            dataserver=dataserver.url,
            token=TOKEN,
            socket_path=sock,
            end_step=3,
        )
    )
    assert len(batches) == 3
    ck = Checkpointer("j1", Layout(dp=1), socket_path=sock)
    for step in range(3):
        ck.save(step, {"w": torch.full((1000,), float(step)), "step": step})
    ck.close()
    until(
        lambda: httpx.get(primary.url + "/v1/state").json()["durable_written"] >= 3,
        what="three durable shards",
    )
    until(
        lambda: {r["step"] for r in httpx.get(successor.url + "/v1/state").json()["replicas"]} >= {1, 2},
        what="replicas on the successor",
    )

    # something of every kind is there to be checked
    assert list(shm_root.glob("j1/data/0/*.arrow")), "no cached step"
    assert list(shm_root.glob("j1/state/*/slot-*.bin")), "no state slot"
    assert list(fresh_root.glob("j1/replica/*/*.bin")), "no replica"
    assert list(shm_root.glob("_index/*.mdb")) and list(fresh_root.glob("_index/*.mdb")), "no index"
    assert len(list(durable.glob("j1/step-*/*.safetensors"))) >= 3, "no durable shard"

    operator_made = f"{shm_root} {stat.filemode(shm_root.lstat().st_mode)}"
    leaks = [p for p in _shared(shm_root) if p != operator_made] + _shared(fresh_root) + _shared(tmp_path / "tier")
    assert not leaks, "group/other can reach:\n" + "\n".join(leaks)
    assert stat.S_IMODE(os.stat(fresh_root).st_mode) == stat.S_IMODE(os.stat(durable).st_mode) == 0o700
