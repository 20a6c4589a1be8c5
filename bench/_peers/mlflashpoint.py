"""Google ML Flashpoint (``ml-flashpoint``, 0.0.10) through its PyTorch DCP adapter.

Save: ``dcp.save(state, storage_writer=MemoryStorageWriter(saver, manager, 1))`` into
``<node folder>/<job>/step-N_ckpt``; the writer copies the rank's tensors into one mmap'd object file
on the node's tmpfs and, as each object is written, its ``ReplicationManager`` starts a push of it
(the C++ ``TransferService``) to the same path on the paired node (``PairwiseReplicationStrategy``,
node index ^ 1). Then each node's local rank 0 writes ``common.pt`` (its latest-checkpoint finder
needs one per node) and ``finalize_checkpoint`` drops the step's "unfinished" marker, waits on a
barrier and starts an ``rm -rf`` of every older step folder on the node. So a node keeps the newest
finalized checkpoint (its rank's object, the paired rank's replica, ``common.pt``; ``.metadata`` on
node 0 only, DCP's coordinator writes it) plus, while a save runs, the one being written: never
more than two. ``.metadata`` is not replicated: with node 0's folder gone nothing restores, though
node 1 holds every object (with node 1's gone, node 0's copies restore both ranks).

Restore (a fresh process): ``get_latest_complete_checkpoint`` (the newest step complete on every
node; it pulls from the paired node what this node lacks) then ``dcp.load`` through
``MemoryStorageReader``. Nothing is checksummed.

Every rank is a node of its own: replication needs the other node to see its own files at the same
path, so ``place`` starts one long-lived holder per node in a private mount namespace, where the
node's folder (on the run's tmpfs, ``huge=within_size`` when peers.py could mount one) is bound onto
one common path; ranks run under ``nsenter`` into their node's namespace, so a restarted rank sees
what its killed predecessor saved. The single-rank state runs on one node: ML Flashpoint does not
replicate there (``replicates`` is False on that instance).

Shims, the least its API leaves to a DCP user: a saver subclass keeps the replication futures
(``write_data`` drops them) so ``wait``/``replicated`` know when a replica landed; the
``TransferService`` is started and the addresses gathered here, because ``ReplicationManager``
without a strategy sizes nodes by ``torch.cuda.device_count()`` (0 on CPU); ``NNODES`` is set per
rank. ``MemoryStorageWriter`` wants a ``torch.multiprocessing`` Manager (a spawned server, as NeMo's
wrapper makes it, ~190 MB); it is made and primed with one ``WriteResult`` (its first unpickling
imports DCP there, ~48 MB) with the rest of a fresh job's setup, so neither counts as memory the
saves hold; a restarted job makes it at its first save. Its logging is set to WARNING (its default
is DEBUG; peers.py runs ffplane's daemons at warning too); its C++ parts log at INFO regardless.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from bench._peers import Ctx, Peer, Unavailable

os.environ.setdefault("MLFLASHPOINT_LOG_LEVEL", "WARNING")  # read when its loggers are made (at import)

ROOT = Path(__file__).resolve().parents[2]
_STEP = re.compile(r"^step-(\d+)_ckpt$")


def _mounted(pid: int, where: Path) -> bool:
    try:
        return any(line.split()[4] == str(where) for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines())
    except (OSError, IndexError):
        return False


@contextlib.contextmanager
def place(world: int, base: Path) -> Iterator[dict[str, Any]]:
    """One mount namespace per node, held by a ``sleep`` (so it outlives the node's SIGKILLed
    ranks), where ``base/nodeN`` is bound onto ``base/mnt``; rank N runs inside node N's. The
    holders are SIGKILLed by PID on the way out; the files go with the run's tmpfs."""
    base = Path(base)
    common = base / "mnt"
    common.mkdir(parents=True)
    holders: list[subprocess.Popen[bytes]] = []
    try:
        for n in range(world):
            node = base / f"node{n}"
            node.mkdir()
            holder = subprocess.Popen(
                [
                    "unshare",
                    "--mount",
                    "--propagation",
                    "private",
                    "sh",
                    "-c",
                    'mount --bind "$0" "$1" && exec sleep infinity',
                    str(node),
                    str(common),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            holders.append(holder)
            deadline = time.monotonic() + 20
            while not _mounted(holder.pid, common):
                if holder.poll() is not None or time.monotonic() > deadline:
                    err = holder.stderr.read().decode(errors="replace").strip() if holder.poll() is not None else "timed out"
                    raise RuntimeError(f"no mount namespace for ML Flashpoint's node {n} (needs root): {err}")
                time.sleep(0.01)
        yield {
            "nodes": [{"work": str(common), "node_folder": str(base / f"node{r}")} for r in range(world)],
            "prefix": [["nsenter", f"--mount=/proc/{h.pid}/ns/mnt", f"--wd={ROOT}", "--"] for h in holders],
            "system_pids": [],
            "config": {},
        }
    finally:
        for h in holders:
            with contextlib.suppress(ProcessLookupError):
                os.kill(h.pid, signal.SIGKILL)
            h.wait()
            if h.stderr:
                h.stderr.close()


class MLFlashpoint(Peer):
    """``dcp.save`` / ``dcp.load`` through ML Flashpoint's ``MemoryStorageWriter`` / ``MemoryStorageReader``."""

    api = "dcp"
    replicates = True

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx)
        try:
            from ml_flashpoint.adapter.pytorch.memory_storage_reader import MemoryStorageReader
            from ml_flashpoint.adapter.pytorch.memory_storage_writer import MemoryStorageWriter
            from ml_flashpoint.checkpoint_object_manager.checkpoint_object_manager import CheckpointObjectManager
            from ml_flashpoint.core.checkpoint_id_types import CheckpointContainerId
            from ml_flashpoint.core.checkpoint_loader import DefaultMLFlashpointCheckpointLoader
            from ml_flashpoint.core.checkpoint_saver import DefaultMLFlashpointCheckpointSaver
            from ml_flashpoint.replication.replication_manager import PairwiseReplicationStrategy, ReplicationManager
            from ml_flashpoint.replication.transfer_service import transfer_service_ext
        except ImportError as exc:
            raise Unavailable(f"ml-flashpoint not installed (bench/setup_peers.sh): {exc}") from None
        if ctx.world > 1 and ctx.world % 2:
            raise Unavailable(f"pairwise replication needs an even number of nodes, not {ctx.world}")
        if ctx.world == 1:
            self.replicates = False  # one node: PairwiseReplicationStrategy replicates nothing
        os.environ["NNODES"] = str(ctx.world)  # one rank per node; it reads the node count from here
        self._Reader, self._ContainerId = MemoryStorageReader, CheckpointContainerId
        self.base = CheckpointContainerId(str(ctx.work / ctx.job))  # job-specific, as its guide asks
        Path(self.base.data).mkdir(parents=True, exist_ok=True)

        self.transfer = transfer_service_ext.TransferService()
        port = self.transfer.initialize(0, global_rank=ctx.rank)
        if port <= 0:
            raise RuntimeError("ML Flashpoint's TransferService did not start")
        addrs: list[Any] = [None] * ctx.world
        dist.all_gather_object(addrs, f"127.0.0.1:{port}")
        # no BufferPool (NeMo's wrapper adds one: 2 buffer files per writer thread, reused): a new
        # mmap'd file per object, as the DCP adapter does by itself
        self.objects = CheckpointObjectManager()
        self.replication = ReplicationManager()
        self.replication.initialize(
            self.objects, replication_transfer_service=self.transfer, repl_strategy=PairwiseReplicationStrategy(addrs, processes_per_node=1)
        )

        class Saver(DefaultMLFlashpointCheckpointSaver):
            """Keeps the futures of the replications its ``write_data`` starts (it drops them)."""

            pushes: list[concurrent.futures.Future]

            def async_replicate_object(self, object_id: Any) -> list[concurrent.futures.Future]:
                futures = super().async_replicate_object(object_id)
                self.pushes.extend(futures)
                return futures

        self.saver = Saver(
            global_rank_getter=dist.get_rank,
            local_rank_getter=dist.get_node_local_rank,
            global_barrier_func=dist.barrier,
            ckpt_obj_manager=self.objects,
            replication_manager=self.replication,
        )  # its default buffer: 16 GiB, ftruncated (sparse), shrunk to what was written before the push
        self.saver.pushes = []
        self.loader = DefaultMLFlashpointCheckpointLoader(
            self.objects,
            self.replication,
            global_rank_getter=dist.get_rank,
            local_rank_getter=dist.get_node_local_rank,
            broadcast_object_list_func=dist.broadcast_object_list,
            all_gather_object_func=dist.all_gather_object,
            world_size_getter=dist.get_world_size,
        )
        # MemoryStorageWriter wants a torch.multiprocessing Manager (a spawned server process, as
        # NeMo's wrapper makes it). A fresh job makes it here, with the rest of its setup; a
        # restarted one (checkpoints on the node) at its first save, so the restore does not wait
        self._manager: Any = None
        self._writer: Any = None
        self._MemoryStorageWriter = MemoryStorageWriter
        if not any(_STEP.match(p.name) for p in Path(self.base.data).iterdir()):
            self._make_writer()
        self._pushes: dict[int, list[concurrent.futures.Future]] = {}
        self._removals: list[subprocess.Popen[bytes]] = []
        self._last: int | None = None

    def _make_writer(self) -> None:
        import torch.multiprocessing as torch_mp

        self._manager = torch_mp.get_context("spawn").Manager()
        # its server imports DCP's classes when it first unpickles a WriteResult (~48 MB): at setup
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.storage import WriteResult

        primer = self._manager.dict()
        primer["x"] = [WriteResult(index=MetadataIndex("x"), size_in_bytes=0, storage_data=_StorageInfo("x", 0, 0))]
        del primer
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(self._manager)
        self._writer = self._MemoryStorageWriter(self.saver, future, thread_count=1)

    def _folder(self, step: int) -> Any:
        return self._ContainerId.create_child(self.base, self._ContainerId.format_version_container(step))

    def save(self, step: int, state: dict[str, Any]) -> None:
        if self._writer is None:
            self._make_writer()
        ckpt = self._folder(step)
        older = self._pushes.get(step - 2)
        if older:  # at most two saves' pushes in flight (when the loop does not wait between saves)
            concurrent.futures.wait(older, timeout=120)
        self.saver.pushes = []
        dcp.save(state, checkpoint_id=str(ckpt), storage_writer=self._writer)
        self._pushes[step] = self.saver.pushes
        for old in [s for s in self._pushes if s < step - 1]:
            del self._pushes[old]
        if dist.get_node_local_rank() == 0:
            torch.save({}, os.path.join(ckpt.data, "common.pt"))
        removal = self.saver.finalize_checkpoint(ckpt)  # rm -rf of the node's older steps, in the background
        if removal is not None:
            self._removals.append(removal)
        self._removals = [p for p in self._removals if p.poll() is None]
        self._last = step

    def wait(self) -> None:
        """Until the last save's replication pushes are acknowledged and its older steps removed."""
        if self._last is not None:
            concurrent.futures.wait(self._pushes.get(self._last, []), timeout=120)
        for p in self._removals:
            p.wait()
        self._removals = []

    def replicated(self, step: int) -> bool:
        """Whether the push of this rank's object of ``step`` landed on the paired node (the
        receiver writes it aside and renames it into place before it acknowledges)."""
        pushes = self._pushes.get(step)
        if not self.replicates or not pushes:
            return False
        return all(f.done() and f.exception() is None and f.result().success for f in pushes)

    def restore(self, into: dict[str, Any]) -> int | None:
        latest = self.loader.get_latest_complete_checkpoint(self.base)
        if latest is None:
            return None
        dcp.load(into, checkpoint_id=str(latest), storage_reader=self._Reader(path=str(latest), checkpoint_loader=self.loader))
        return self._ContainerId.parse_version_container_step(os.path.basename(latest.data))

    def newest_file(self) -> Path | None:
        """This rank's own object in the node's newest finalized step (the paired rank's replica
        beside it is read by the other rank, so a flip there would go unread)."""
        root = Path(self.base.data)
        names = {p.name for p in root.iterdir()}
        steps = [
            int(m.group(1))
            for name in names
            if (m := _STEP.match(name)) and not any(n.startswith(name + "__") and n.endswith("unfinished") for n in names)
        ]
        if not steps:
            return None
        files = [p for p in (root / f"step-{max(steps)}_ckpt").iterdir() if p.is_file() and p.suffix == ".distcp"]
        mine = [p for p in files if re.search(rf"_src{self.ctx.rank}\.distcp$", p.name)]
        return max(mine or files, key=lambda p: p.stat().st_size) if files else None

    def held_paths(self) -> list[Path]:
        return [self.ctx.work]  # the node's folder: its objects, the paired node's replicas, markers

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.wait()
        self.replication.shutdown()
        if self._manager is not None:
            self._manager.shutdown()
