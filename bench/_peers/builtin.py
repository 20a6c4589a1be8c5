"""ffplane (its own API and DCP through it) and the savers torch ships: ``torch.save`` to /dev/shm,
DCP's ``FileSystemWriter`` to /dev/shm, and ``dcp.async_save`` with DCP's default stager."""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from bench._peers import Ctx, Peer
from bench._peers.states import leaves
from trainer_client import Checkpointer, Layout, settle_all
from trainer_client.dcp import DaemonReader, DaemonWriter


def _copy_into(into: dict[str, Any], loaded: dict[str, Any]) -> None:
    for dst, src in zip(leaves(into), leaves(loaded), strict=True):
        dst.copy_(src)


def _largest(folder: Path) -> Path | None:
    files = [p for p in folder.rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size) if files else None


class _Daemon(Peer):
    """Shared by both ffplane rows: the node daemon's socket, and whether the other node holds
    a complete replica (its ``/v1/state``)."""

    replicates = True

    def before_step(self) -> None:
        settle_all()  # the last save answered before the step's collective: two copies a side, not three

    def _replica_on_peer(self, role: str | None, step: int) -> bool:
        """Whether the next node holds a complete replica of ``step`` (of ``role``; None: any)."""
        with urllib.request.urlopen(f"{self.ctx.config['peer_url']}/v1/state", timeout=5) as resp:
            held = json.loads(resp.read())["replicas"]
        return any(r["job"] == self.ctx.job and r["step"] == step and r["kind"] != "incoming" and role in (None, r["role"]) for r in held)

    def held_paths(self) -> list[Path]:
        return [Path(p) for p in self.ctx.config["roots"]]

    def newest_file(self) -> Path | None:
        """The slot file of this node's newest committed version of the job."""
        with urllib.request.urlopen(f"{self.ctx.config['url']}/v1/state", timeout=5) as resp:
            roles = json.loads(resp.read())["roles"]
        versions = [v for r in roles if r["job"] == self.ctx.job for v in r["versions"]]
        if not versions:
            return None
        return Path(self.ctx.config["roots"][0]) / max(versions, key=lambda v: v["step"])["slot"]


class FFPlane(_Daemon):
    """``Checkpointer.save`` / ``restore``: the state copied into the node daemon's slots, replicated
    to the next node. DDP state is razored (each rank keeps 1/dp of it)."""

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx)
        if ctx.replicated_state:
            layout = Layout(dp=ctx.world, dp_rank=ctx.rank)
        else:
            layout = Layout(tp=ctx.world, tp_rank=ctx.rank)
        self.ck = Checkpointer(ctx.job, layout, socket_path=ctx.config["socket"])

    def save(self, step: int, state: dict[str, Any]) -> None:
        self.ck.save(step, state)

    def wait(self) -> None:
        self.ck.wait()

    def replicated(self, step: int) -> bool:
        return self._replica_on_peer(self.ck.role, step)

    def restore(self, into: dict[str, Any]) -> int | None:
        got = self.ck.restore(into=into)
        return None if got is None else got.step

    def close(self) -> None:
        self.ck.close()


class FFPlaneDCP(_Daemon):
    """``dcp.save(state, storage_writer=DaemonWriter(job), checkpoint_id=step)``, every save after
    the first with ``no_dist=True`` (the writer reuses the first save's plan: no DCP collectives);
    ``dcp.load(..., DaemonReader(job))`` to restore."""

    api = "dcp"
    steady = True

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx)
        self.writer = DaemonWriter(ctx.job, socket_path=ctx.config["socket"])
        self.saves = 0

    def save(self, step: int, state: dict[str, Any]) -> None:
        dcp.save(state, storage_writer=self.writer, checkpoint_id=step, no_dist=self.steady and self.saves > 0)
        self.saves += 1

    def wait(self) -> None:
        self.writer.wait()

    def replicated(self, step: int) -> bool:
        return self._replica_on_peer(None, step)  # the writer's role is its rank's

    def restore(self, into: dict[str, Any]) -> int | None:
        reader = DaemonReader(self.ctx.job, socket_path=self.ctx.config["socket"])
        try:
            dcp.load(into, storage_reader=reader)
        finally:
            reader.close()
        return reader.step

    def close(self) -> None:
        self.writer.close()


class FFPlaneDCPFull(FFPlaneDCP):
    """``FFPlaneDCP`` with DCP's whole protocol on every save (plans gathered and scattered, the
    results gathered): what a DCP trainer gets without ``no_dist``."""

    steady = False


class TorchSave(Peer):
    """``torch.save`` of the rank's state to a file in /dev/shm (written aside, then renamed, so a
    kill mid-save leaves the previous one); ``torch.load(mmap=True)`` then a copy to restore."""

    def save(self, step: int, state: dict[str, Any]) -> None:
        tmp = self.ctx.work / "next.pt"
        torch.save({"step": step, "state": state}, tmp)
        tmp.rename(self.ctx.work / "latest.pt")

    def restore(self, into: dict[str, Any]) -> int | None:
        path = self.ctx.work / "latest.pt"
        if not path.exists():
            return None
        got = torch.load(path, mmap=True, weights_only=True)
        _copy_into(into, got["state"])
        return int(got["step"])

    def newest_file(self) -> Path | None:
        path = self.ctx.work / "latest.pt"
        return path if path.exists() else None


class _DCPFolders(Peer):
    """DCP checkpoints as ``step-N`` folders under the work folder (on a shared host every rank's
    work folder is its node's). The newest complete one (its ``.metadata`` written) restores."""

    api = "dcp"
    keep = 2

    def _folder(self, step: int) -> Path:
        return self.ctx.work / f"step-{step}"

    def _prune(self, newest: int) -> None:
        if self.ctx.rank != 0:
            return
        for old in sorted(self._steps())[: -self.keep]:
            if old != newest:
                shutil.rmtree(self._folder(old), ignore_errors=True)

    def _steps(self) -> list[int]:
        return [int(p.name[5:]) for p in self.ctx.work.glob("step-*") if (p / ".metadata").exists()]

    def restore(self, into: dict[str, Any]) -> int | None:
        steps = self._steps()
        newest = max(steps) if steps else -1
        if dist.is_initialized() and dist.get_world_size() > 1:
            agreed = torch.tensor([newest])
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)  # the newest step every rank sees whole
            newest = int(agreed)
        if newest < 0:
            return None
        dcp.load(into, storage_reader=dcp.FileSystemReader(str(self._folder(newest))))
        return newest

    def newest_file(self) -> Path | None:
        steps = self._steps()
        return _largest(self._folder(max(steps))) if steps else None


class DCPFileSystem(_DCPFolders):
    """``dcp.save`` with ``FileSystemWriter`` into /dev/shm."""

    def save(self, step: int, state: dict[str, Any]) -> None:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(self._folder(step))))
        self._prune(step)


class DCPAsync(_DCPFolders):
    """``dcp.async_save`` with DCP's default stager into /dev/shm (the "zero-overhead" path: the
    call returns once the state is staged; the write happens on a background thread). Its
    collectives run on their own gloo group, as DCP asks."""

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx)
        self.pending: Any = None
        self.side = dist.new_group(backend="gloo") if dist.is_initialized() else None

    def save(self, step: int, state: dict[str, Any]) -> None:
        self.wait()  # DCP's docs: one async save in flight
        self.pending = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(str(self._folder(step))), process_group=self.side)
        self._last = step

    def wait(self) -> None:
        if self.pending is not None:
            fut, self.pending = self.pending, None
            (fut.result() if hasattr(fut, "result") else fut.upload_completion.result())
            self._prune(self._last)
