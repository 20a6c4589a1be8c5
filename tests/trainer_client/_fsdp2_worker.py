"""One rank of a small FSDP2 (``fully_shard``) job on CPU/gloo, launched by torchrun.

``train SOCKET OUT STEPS``: train STEPS optimizer steps, saving the model's and optimizer's
sharded state after each; write the full weights and optimizer moments at the end to OUT.
A trailing ``tp=2`` builds the job on a 2-D ``(dp, tp)`` mesh: tensor parallel inside FSDP2;
``replicate=2`` on a ``(dp_replicate, dp_shard)`` mesh: HSDP; ``cuda=1`` on the GPUs over NCCL
(one rank per GPU).
``restore SOCKET OUT``: build the same job, restore the newest step twice — into the live
sharded state, and as new DTensors on the mesh loaded with ``load_state_dict`` — and write what
each holds to OUT (``.into`` / ``.mesh``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tests.trainer_client._torchrun import exit_worker
from trainer_client import Checkpointer, Layout


def _job(tp: int = 1, replicate: int = 1, cuda: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """The MLP sharded by FSDP2 over the world; with ``tp`` > 1 over a 2-D ``(dp, tp)`` mesh
    (tensor parallel, column-wise then row-wise, inside each dp group, FSDP2 across them); with
    ``replicate`` > 1 as HSDP: ``replicate`` groups, each sharding the whole state over its ranks."""
    torch.manual_seed(0)
    device = "cuda" if cuda else "cpu"
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 8)).to(device)
    world = dist.get_world_size()
    if replicate > 1:
        mesh = dp_mesh = init_device_mesh(device, (replicate, world // replicate), mesh_dim_names=("dp_replicate", "dp_shard"))
    elif tp == 1:
        mesh = dp_mesh = init_device_mesh(device, (world,))
    else:
        mesh = init_device_mesh(device, (world // tp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        dp_mesh = mesh["dp"]
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), mesh


def mesh_args(argv: list[str]) -> tuple[list[str], dict[str, int]]:
    """The arguments without ``tp=N`` / ``replicate=N`` / ``cuda=1`` ones, and those as ``_job``'s keywords."""
    named = ("tp=", "replicate=", "cuda=")
    shape = {a.split("=")[0]: int(a.split("=")[1]) for a in argv if a.startswith(named)}
    return [a for a in argv if not a.startswith(named)], shape


def _local(state: dict[Any, Any]) -> list[torch.Tensor]:
    out = []
    for v in state.values():
        if isinstance(v, dict):
            out += _local(v)
        elif isinstance(v, torch.Tensor):
            out.append(v.to_local() if hasattr(v, "to_local") else v)
    return out


def _full(state: dict[str, object]) -> dict[str, torch.Tensor]:
    """Every tensor of a state, gathered whole (a collective: every rank calls it)."""
    out: dict[str, torch.Tensor] = {}

    def walk(node: object, key: str) -> None:
        if isinstance(node, torch.Tensor):
            out[key] = (node.full_tensor() if hasattr(node, "full_tensor") else node.clone()).cpu()
        elif isinstance(node, dict):
            for k, v in sorted(node.items(), key=lambda kv: str(kv[0])):
                walk(v, f"{key}/{k}")

    walk(state, "")
    return out


def main() -> None:
    argv, shape = mesh_args(sys.argv)
    tp = shape.get("tp", 1)
    mode, sock = argv[1], argv[2]
    cuda = shape.get("cuda", 0)
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    model, opt, mesh = _job(**shape)
    device = next(model.parameters()).device
    ckpt = Checkpointer("fsdp2", Layout.from_mesh(mesh), socket_path=sock)  # the role from the mesh
    if mode == "train":
        gen = torch.Generator().manual_seed(rank // tp)  # a tp group sees the same batch
        for step in range(1, int(argv[4]) + 1):
            x = torch.randn(16, 24, generator=gen).to(device)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
        ckpt.wait()
        full = {**_full(model.state_dict()), **_full(opt.state_dict()["state"])}
        local = torch.tensor([sum(t.nbytes for t in _local(model.state_dict()) + _local(opt.state_dict()["state"]))], device=device)
        dist.all_reduce(local)  # what every rank holding its own copy of its local parts would save
        if rank == 0:
            torch.save({**full, "local_bytes": local.cpu()}, argv[3])
    else:
        # the live state needs the optimizer's moments to exist: one step of zero gradients
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        live = {"model": model.state_dict(), "optim": opt.state_dict()}
        into = ckpt.restore(into=live)
        assert into is not None
        got_into = {**_full(model.state_dict()), **_full(opt.state_dict()["state"])}
        fresh_model, fresh_opt, _ = _job(**shape)
        again = ckpt.restore(mesh=mesh)
        assert again is not None and again.step == into.step
        devices = sorted({t.device.type for t in _local(again.state["model"])})  # the mesh's, not the host's
        fresh_model.load_state_dict(again.state["model"])
        got_mesh = _full(fresh_model.state_dict())
        if rank == 0:
            torch.save({"step": into.step, "into": got_into, "mesh": got_mesh, "mesh_devices": devices}, argv[3])
    ckpt.close()
    dist.barrier()  # no rank tears its process group down while another still writes its result
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_worker()
