"""NVIDIA Resiliency Extension (``nvidia-resiliency-ext`` 0.7.0) local checkpointing:
``LocalCheckpointManager(root, session_id, repl_strategy)`` with
``CliqueReplicationStrategy.from_replication_params(replication_jump=1, replication_factor=2)``:
``save(state, iteration)`` exchanges every rank's shard with its clique peer (an all-gather) and
``torch.save``s its own file and the peer's into its node's root; ``find_latest()`` + ``load()``
restore the newest iteration every rank's file is somewhere for (a missing one comes from the
peer that holds its replica).

Two CPU shims, NVRx's state-dict class being CUDA-only: :class:`CpuTensorAwareStateDict` (the
basic one, without its "every tensor is on CUDA" check and its move back to CUDA on load; it
lives here because the manager pickles the object and unpickles it by its module path) and
:func:`patch_replica_retrieval_for_cpu` (fetching a replica from a peer stages every tensor
through CUDA; the same two functions without that).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench._peers import Ctx, Peer, Unavailable
from bench._peers.states import leaves

try:
    from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
except ImportError as exc:  # the rank's constructor says why
    MISSING: str | None = str(exc)
    BasicTensorAwareStateDict = object  # type: ignore[assignment,misc]
else:
    MISSING = None


class CpuTensorAwareStateDict(BasicTensorAwareStateDict):  # type: ignore[misc,valid-type]
    """``BasicTensorAwareStateDict`` for CPU tensors."""

    def __init__(self, state_dict: dict[str, Any]) -> None:  # the base asserts every tensor .is_cuda
        self.state_dict = state_dict
        self._is_hollow = False

    def restore_tensor_device(self, non_blocking: bool = True) -> None:  # the base moves them .to("cuda")
        pass


def patch_replica_retrieval_for_cpu() -> None:
    """``GroupWrapper.isend_state_dict`` / ``irecv_state_dict`` (``load()`` on a rank whose own
    file is gone) stage every tensor through CUDA (``ten.cuda()``, ``empty_like(device='cuda')``);
    these are the same functions on the tensors' own device."""
    import torch.distributed as dist
    from nvidia_resiliency_ext.checkpointing.local.replication.group_utils import GroupWrapper

    def isend_state_dict(self: Any, state_dict: Any, dst: int) -> dict[str, int]:
        tensor_data = state_dict.pop_tensors()
        log_data = {"data_sent": sum(ten.nbytes for ten in tensor_data)}
        self.send_object(state_dict, dst)
        for ten in tensor_data:
            dist.send(ten.contiguous(), dst, group=self.group)
        state_dict.insert_tensors(tensor_data)
        return log_data

    def irecv_state_dict(self: Any, src: int) -> tuple[Any, dict[str, int]]:
        hollow_ckpt = self.recv_object(src)
        hollow_ckpt.init_tensors()
        for ten in hollow_ckpt.tensors:
            dist.recv(ten, src, group=self.group)
        return hollow_ckpt, {"data_recv": sum(ten.nbytes for ten in hollow_ckpt.tensors)}

    GroupWrapper.isend_state_dict = isend_state_dict
    GroupWrapper.irecv_state_dict = irecv_state_dict


def _skeleton(node: Any) -> Any:
    """The same nesting of dicts and lists holding the same tensors (``save`` empties the dicts
    and lists it is given, leaving placeholders where the tensors were)."""
    if isinstance(node, dict):
        return {k: _skeleton(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_skeleton(v) for v in node]
    return node


@contextlib.contextmanager
def place(world: int, base: Path) -> Iterator[dict[str, Any]]:
    """A root folder per node, and the folder of the node that holds each rank's replica."""
    roots = [base / f"node{r}" for r in range(world)]
    nodes = [{"work": str(roots[r]), "peer_work": str(roots[r ^ 1]) if world > 1 else None} for r in range(world)]
    yield {"nodes": nodes, "prefix": [[] for _ in range(world)], "system_pids": [], "config": {}}


class NVRx(Peer):
    """``LocalCheckpointManager`` with clique replication (2 ranks, the other node holds each
    rank's file). ``save`` is synchronous: the async path (``is_async=True`` and an
    ``AsyncCallsQueue``) calls ``torch.cuda.synchronize()`` and syncs its callers with tensors on
    ``torch.cuda.current_device()``, so on CPU torch the synchronous one is what can be measured
    (the exchange with the peer happens inside ``save`` either way). Each rank saves what it holds
    (DDP: the whole state, so a node holds two whole copies; ``BasicTensorAwareStateDict`` has no
    deduplication); files are ``torch.save`` pickles written aside (``.dirty``) then renamed,
    without checksums, and the manager keeps only the newest complete iteration. One rank alone
    (``single``) has no clique: no replication."""

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx)
        if MISSING is not None:
            raise Unavailable(f"nvidia-resiliency-ext not installed: {MISSING}")
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
        from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy

        patch_replica_retrieval_for_cpu()
        self.replicates = ctx.world > 1
        strategy = None
        if self.replicates:  # the jump defaults to torch.cuda.device_count(), 0 on CPU
            strategy = CliqueReplicationStrategy.from_replication_params(replication_jump=1, replication_factor=2)
        self.mgr = LocalCheckpointManager(ctx.work, session_id=ctx.job, repl_strategy=strategy)

    def _file(self, root: Path, holder: int, step: int) -> Path:
        """Rank ``self.ctx.rank``'s file of ``step`` in ``holder``'s folder under ``root``."""
        return root / self.ctx.job / str(holder) / f"iter_{step:07d}_{self.ctx.rank}_local.pt"

    def save(self, step: int, state: dict[str, Any]) -> None:
        self.mgr.save(CpuTensorAwareStateDict(_skeleton(state)), step)

    def replicated(self, step: int) -> bool:
        peer = self.ctx.config.get("peer_work")
        return peer is not None and self._file(Path(peer), self.ctx.rank ^ 1, step).is_file()

    def restore(self, into: dict[str, Any]) -> int | None:
        if self.mgr.find_latest() < 0:
            return None
        got, (step, _, _) = self.mgr.load()
        for dst, src in zip(leaves(into), leaves(got.state_dict), strict=True):
            dst.copy_(src)
        return int(step)

    def newest_file(self) -> Path | None:
        mine = sorted(self.mgr.local_ckpt_dir.glob(f"iter_*_{self.ctx.rank}_local.pt"))
        return mine[-1] if mine else None  # zero-padded iterations: the last name is the newest
