"""One rank of bench/dcp.py (launched by torchrun): an FSDP2 model + AdamW state saved and
loaded by each contender in turn, timings written per rank as JSON.

    python -m torch.distributed.run --nproc-per-node 2 -m bench._dcp_job SOCKET SHM_DIR OUT.json MIB REPEATS
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter, StorageWriter
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.futures import Future

from trainer_client import Checkpointer, Layout
from trainer_client.dcp import DaemonReader, DaemonWriter


def fsdp2_job(total_mib: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """Params of total_mib / 3 (AdamW's two moments make the rest), sharded over the world."""
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    width = 2048
    layers = max(1, total_mib * 2**20 // 3 // (width * width * 4))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, width)).sum().backward()
    opt.step()  # the moments exist
    opt.zero_grad()
    return model, opt, mesh


class _NullWriter(StorageWriter):
    """Writes nothing: ``dcp.save`` through it costs only DCP's own protocol (planning, two
    rounds of object collectives), the floor under any storage writer."""

    def reset(self, checkpoint_id: Any = None) -> None: ...
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None: ...
    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    def write_data(self, plan: Any, planner: Any) -> Future[list[WriteResult]]:
        fut: Future[list[WriteResult]] = Future()
        fut.set_result([WriteResult(index=i.index, size_in_bytes=0, storage_data=None) for i in plan.items])
        return fut

    def finish(self, metadata: Any, results: Any) -> None: ...

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def storage_meta(self) -> None:
        return None


def _timed(fn: Any) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    sock, shm, out, total_mib, repeats = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt, mesh = fsdp2_job(total_mib)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    local_bytes = sum(
        t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes
        for part in (model.state_dict(), opt.state_dict()["state"])
        for t in _tensors(part)
    )
    times: dict[str, list[float]] = {}
    ckpt = Checkpointer("bench-ckpt", Layout.from_mesh(mesh), socket_path=sock)
    writer = DaemonWriter("bench-dcp", socket_path=sock)
    step = 0

    def record(name: str, fn: Any, settle: Any = None) -> None:
        nonlocal step
        fn()  # warm-up: slots, plans, page faults
        for _ in range(repeats):
            step += 1
            if settle is not None:
                settle()  # a training step would run here, long enough for the last save to finish
            times.setdefault(name, []).append(_timed(fn))

    record(
        "checkpointer_save_s", lambda: (ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict()}), None), settle=ckpt.wait
    )
    ckpt.wait()
    record("dcp_protocol_floor_s", lambda: dcp.save(state, storage_writer=_NullWriter()))

    def start_commit() -> None:  # the daemon commits a shard of this size while DCP's protocol runs
        ckpt.wait()
        ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})

    record("dcp_protocol_floor_committing_s", lambda: dcp.save(state, storage_writer=_NullWriter()), settle=start_commit)
    ckpt.wait()
    record("dcp_ffplane_save_s", lambda: dcp.save(state, storage_writer=writer, checkpoint_id=step), settle=writer.wait)
    cached = DefaultSavePlanner(enable_plan_caching=True)  # a steady-state trainer's plan does not change
    record(
        "dcp_ffplane_save_cached_plan_s",
        lambda: dcp.save(state, storage_writer=writer, checkpoint_id=step, planner=cached),
        settle=writer.wait,
    )
    writer.wait()
    # steady state: the plan of the last full save, no DCP collectives (DaemonWriter's no_dist path)
    record(
        "dcp_ffplane_save_no_dist_s", lambda: dcp.save(state, storage_writer=writer, checkpoint_id=step, no_dist=True), settle=writer.wait
    )
    writer.wait()
    pending: list[Any] = []
    side = dist.new_group(backend="gloo")  # async saves run their collectives on their own group, as DCP asks

    def finish_pending() -> None:
        while pending:
            pending.pop().result()

    def async_ffplane() -> None:
        pending.append(dcp.async_save(state, storage_writer=writer, checkpoint_id=step, process_group=side))

    record("dcp_ffplane_async_save_s", async_ffplane, settle=lambda: (finish_pending(), writer.wait()))
    pending.pop().result()
    writer.wait()

    def fs(path: Path) -> FileSystemWriter:
        if rank == 0 and path.exists():
            shutil.rmtree(path)
        dist.barrier()
        return FileSystemWriter(str(path))

    record("dcp_filesystem_shm_save_s", lambda: dcp.save(state, storage_writer=fs(shm / f"fs-{step}")))

    def async_fs() -> None:
        pending.append(dcp.async_save(state, storage_writer=fs(shm / f"afs-{step}"), process_group=side))

    record("dcp_filesystem_shm_async_save_s", async_fs, settle=finish_pending)
    pending.pop().result()

    # restores, each into the live sharded state
    record("checkpointer_restore_s", lambda: ckpt.restore(into={"model": model.state_dict(), "optim": opt.state_dict()}))
    record("dcp_ffplane_load_s", lambda: dcp.load(state, storage_reader=DaemonReader("bench-dcp", socket_path=sock)))
    newest = sorted(shm.glob("fs-*"), key=lambda p: int(p.name[3:]))[-1]
    record("dcp_filesystem_shm_load_s", lambda: dcp.load(state, storage_reader=FileSystemReader(str(newest))))
    ckpt.close()
    writer.close()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rank": rank, "local_bytes": local_bytes, "times": times})
    if rank == 0:
        out.write_text(json.dumps(gathered))
    dist.destroy_process_group()


def _tensors(node: Any) -> list[Any]:
    if isinstance(node, torch.Tensor):
        return [node]
    if isinstance(node, dict):
        return [t for v in node.values() for t in _tensors(v)]
    return []


if __name__ == "__main__":
    main()
