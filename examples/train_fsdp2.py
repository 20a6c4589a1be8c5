"""The example GPT sharded with FSDP2 (``fully_shard``): each rank holds 1/world of the weights
and of the AdamW moments, saved every step as DTensors and restored onto the mesh wherever a rank
lands.  torchrun ... train_fsdp2.py --job J --out D [--checkpoint ffplane|dcp]

``--checkpoint ffplane`` (default) saves with the ``Checkpointer``; ``--checkpoint dcp`` keeps a
torchtitan-style trainer's checkpoint code — ``dcp.save`` / ``dcp.load`` of Stateful objects —
and only swaps in ffplane's ``DaemonWriter`` / ``DaemonReader`` as the storage.
"""

import argparse
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from train_ffplane import GPT

from trainer_client import Checkpointer, DataLoader, Layout, settle_all
from trainer_client.dcp import DaemonReader, DaemonWriter


class ModelAndOptimizer(Stateful):
    """Model and optimizer state as one Stateful object, the way DCP trainers hold them."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--checkpoint", choices=("ffplane", "dcp"), default="ffplane")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = GPT()
    for block in model.blocks.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(args.job, rank)
    app = ModelAndOptimizer(model, opt)
    if args.checkpoint == "dcp":
        # the loader's position is per rank: a key of its own, as torchtitan keys it by dp rank
        state: dict[str, Any] = {"app": app, f"loader_dp{rank}": loader}
        reader = DaemonReader(args.job)
        step = reader.find()  # the newest step every rank can load, or None
        if step is not None:
            dcp.load(state, storage_reader=reader, checkpoint_id=step)
        reader.close()
        writer = DaemonWriter(args.job)
    else:
        ckpt = Checkpointer(args.job, Layout.from_mesh(mesh))
        saved = ckpt.restore(mesh=mesh)  # DTensors on this mesh, from this node or another
        if saved is not None:
            app.load_state_dict(saved.state)
            loader.load_state_dict(saved.state["loader"])
    for batch in loader:
        step = loader.next_step - 1
        x = batch["tokens"].long() % 512
        loss = nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        # the last save's replica exists before backward's reduce-scatters run: a node lost
        # costs at most one step, and the daemons keep two copies of each shard, not three
        settle_all()
        loss.backward()
        opt.step()
        if args.checkpoint == "dcp":
            dcp.save(state, storage_writer=writer, checkpoint_id=step)
        else:
            ckpt.save(step, {**app.state_dict(), "loader": loader.state_dict()})
        loss = loss.detach()
        dist.all_reduce(loss)  # the job's mean loss: every rank's batch differs
        if rank == 0:
            print(f"step {step} loss {loss.item() / world:.6f}", flush=True)
        if step == args.steps - 1:
            break
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}  # every rank gathers
    if rank == 0:
        torch.save(full, os.path.join(args.out, "final.pt"))
    (writer if args.checkpoint == "dcp" else ckpt).close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
