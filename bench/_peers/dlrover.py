"""DLRover flash checkpoint (``dlrover[torch]`` 0.6.1): ``DdpCheckpointer.save_checkpoint(step,
state, storage_type=StorageType.MEMORY)`` copies the state into a POSIX shared-memory buffer on the
node; ``load_checkpoint()`` in a restarted trainer reads it back.

The buffer's metadata (shapes, offsets, the step) lives in the saver, a long-lived process on the
node: ``dlrover-run``'s elastic agent runs it, and a trainer started by the agent
(``ROLE_NAME=dlrover-trainer``) only talks to it. A trainer started any other way forks its own
saver as a daemon child, which dies with the trainer, so a fresh process gets ``{}`` (silently).
``dlrover-run`` itself does not start with torch 2.13, so :func:`place` starts per node what its
agent would (``AsyncCheckpointSaver.start_async_saving_ckpt()``, this module run as ``agent``) and
gives each rank the environment torchelastic gives a worker of a 2-node job with one process per
node (``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``TORCHELASTIC_RUN_ID``).

Each node's ``/dev/shm`` is a folder of its own on the run's tmpfs: the agent runs in a mount
namespace (``unshare -m``) with that folder bound over ``/dev/shm``, and its node's rank joins the
namespace (``nsenter``). The agents' socket folders (``/tmp/ckpt_sock/<run id>``) and, where the
run's tmpfs is itself under ``/dev/shm``, the buffers (``/dev/shm/<run id>_ckpt_shm_0``) are the
host's, told apart by a run id per node, and removed when the run ends.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench._peers import Ctx, Peer, Unavailable
from bench._peers.states import leaves

ROOT = Path(__file__).resolve().parents[2]
SOCKETS = Path("/tmp/ckpt_sock")  # dlrover.python.common.multi_process.SOCKET_TMP_DIR


def _worker_env(rank: int, world: int, run_id: str) -> list[str]:
    """What torchelastic (under ``dlrover-run``) sets for the one worker of node ``rank``."""
    return [
        "env",
        f"TORCHELASTIC_RUN_ID={run_id}",
        "ROLE_NAME=dlrover-trainer",
        f"GROUP_RANK={rank}",
        f"GROUP_WORLD_SIZE={world}",
        f"NODE_RANK={rank}",
        "LOCAL_WORLD_SIZE=1",
    ]


def _wait_for(path: Path, agent: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if agent.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-600:] if log.exists() else ""
            raise RuntimeError(f"DLRover agent did not come up (exit {agent.poll()}): {tail}")
        time.sleep(0.05)


@contextlib.contextmanager
def place(world: int, base: Path) -> Iterator[dict[str, Any]]:
    """One saver agent per node (each with its own ``/dev/shm``); each rank runs under its node's."""
    nodes = [{"work": str(base / f"node{r}" / "work")} for r in range(world)]
    if importlib.util.find_spec("dlrover") is None:  # the rank's constructor says why
        yield {"nodes": nodes, "prefix": [[] for _ in range(world)], "system_pids": []}
        return
    base.mkdir(parents=True, exist_ok=True)
    # a bind over /dev/shm would hide the run's folders where the run's tmpfs is /dev/shm itself
    namespaces = not base.resolve().is_relative_to("/dev/shm")
    run = f"ffp{secrets.token_hex(3)}"
    agents: list[subprocess.Popen[bytes]] = []
    prefix: list[list[str]] = []
    try:
        for r in range(world):
            run_id = f"{run}n{r}"
            shm = base / f"node{r}" / "shm" if namespaces else Path("/dev/shm")
            shm.mkdir(parents=True, exist_ok=True)
            nodes[r] |= {"run_id": run_id, "shm": str(shm)}
            env = {**os.environ, "TORCHELASTIC_RUN_ID": run_id, "NODE_RANK": str(r), "PYTHONPATH": str(ROOT)}
            argv = [sys.executable, "-m", "bench._peers.dlrover", "agent"]
            if namespaces:
                argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", 'mount --bind "$0" /dev/shm && exec "$@"', str(shm), *argv]
            log = base / f"agent{r}.log"
            with open(log, "ab") as out:
                agents.append(subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
            _wait_for(SOCKETS / run_id / "sharedqueue_factory.sock", agents[-1], log)
            enter = ["nsenter", f"--mount=/proc/{agents[-1].pid}/ns/mnt", "--wd=" + str(ROOT)] if namespaces else []
            prefix.append([*enter, *_worker_env(r, world, run_id)])
        yield {"nodes": nodes, "prefix": prefix, "system_pids": [a.pid for a in agents], "config": {}}
    finally:
        for a in agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(a.pid, signal.SIGKILL)
            a.wait()
        for node in nodes:
            if "run_id" in node:
                shutil.rmtree(SOCKETS / node["run_id"], ignore_errors=True)
                for f in Path(node["shm"]).glob(f"{node['run_id']}_ckpt_shm_*"):
                    f.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            SOCKETS.rmdir()  # only when no other run's folder is left in it


class DLRover(Peer):
    """``DdpCheckpointer`` with ``StorageType.MEMORY``: a synchronous copy into the node's shared
    memory, one buffer per node overwritten in place by every save. There is no older version to
    fall back on: a kill while a save is being copied leaves that node's buffer marked unfinished
    or the nodes holding different steps, and ``load_checkpoint`` then returns ``{}`` on every
    rank (nothing restores). A kill inside the agent's metadata update can also wedge the agent,
    and every later ``load_checkpoint`` hangs: :meth:`restore` checks for that first and fails
    instead. No checksum.

    DDP state: the checkpointer's defaults (``local_shard_num=1, global_shard_num=1``), what a
    user gets: the local rank 0 of every node saves the whole state into its node's memory (here,
    one rank per node, every rank). FSDP2 state: ``global_shard_num`` = the world size, as its
    docstring says for a model partitioned over all ranks, so each rank's shard is its own. The
    copy stays on its node: ``replica_count`` (default 0, kept) would all-gather the shards of a
    sharded state to the other nodes inside every save, with the replicas' metadata held by the
    trainer process (gone when every trainer restarts). The save's step goes in the dict
    (``load_checkpoint`` returns only the dict)."""

    replicates = False

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx)
        try:
            from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType
        except ImportError as exc:
            raise Unavailable(f"dlrover[torch] not installed: {exc}") from None
        if "run_id" not in ctx.config:
            raise Unavailable("no DLRover agent on the node (run through bench/peers.py, which starts one per node)")
        self.memory = StorageType.MEMORY
        shards = 1 if ctx.replicated_state else ctx.world
        self.ck = DdpCheckpointer(str(ctx.work / "storage"), local_shard_num=1, global_shard_num=shards)

    def save(self, step: int, state: dict[str, Any]) -> None:
        self.ck.save_checkpoint(step, {"step": step, "state": state}, storage_type=self.memory)

    def _wedged(self) -> bool:
        """Whether this node's agent will never answer a read of the buffer's metadata. A trainer
        killed inside ``SharedDict.set`` (after it posted to the dict's notification queue, before
        the agent took the new dict) leaves that queue non-empty, and the agent serves a ``get``
        only once the queue is empty: ``load_checkpoint()`` then blocks forever (seen here)."""
        from dlrover.python.common.multi_process import SharedQueue
        from dlrover.python.elastic_agent.torch.ckpt_saver import CheckpointSharedObjPrefix

        return not SharedQueue(name=f"shard_dict_{CheckpointSharedObjPrefix.META_NAME}0").empty()

    def restore(self, into: dict[str, Any]) -> int | None:
        wedged = torch.tensor([int(self._wedged())])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(wedged, op=dist.ReduceOp.MAX)  # a rank whose load hangs stalls the others' too
        if wedged.item():
            raise RuntimeError(
                "load_checkpoint() would block forever: a trainer SIGKILLed inside the agent's "
                "SharedDict.set left its notification queue non-empty (DLRover 0.6.1)"
            )
        got = self.ck.load_checkpoint()
        if not got:
            return None
        for dst, src in zip(leaves(into), leaves(got["state"]), strict=True):
            dst.copy_(src)  # src is a view of the shared memory
        return int(got["step"])

    def _buffers(self) -> list[Path]:
        return sorted(Path(self.ctx.config["shm"]).glob(f"{self.ctx.config['run_id']}_ckpt_shm_*"))

    def newest_file(self) -> Path | None:
        got = self._buffers()
        return max(got, key=lambda p: p.stat().st_size) if got else None

    def held_paths(self) -> list[Path]:
        return self._buffers()


def _agent() -> None:
    """What ``dlrover-run``'s agent runs for flash checkpoint: the saver factory, then waits."""
    from dlrover.python.elastic_agent.torch.ckpt_saver import AsyncCheckpointSaver

    AsyncCheckpointSaver.start_async_saving_ckpt()
    while True:
        time.sleep(60)


if __name__ == "__main__" and sys.argv[1:] == ["agent"]:
    _agent()
