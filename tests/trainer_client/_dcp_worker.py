"""One rank of a small FSDP2 job that checkpoints through ``torch.distributed.checkpoint`` with
ffplane's storage, launched by torchrun on CPU/gloo.

``save SOCKET OUT STEPS``: train STEPS steps, ``dcp.save`` after each (the last one with
``dcp.async_save``), and write the full weights, optimizer moments, scheduler and step to OUT.
``load SOCKET OUT``: build the same job on this world size (resharding when it differs), load the
newest step with ``dcp.load``, write what it holds to OUT, then save one more step (``--then``).
A trailing ``tp=2`` builds the job on a 2-D ``(dp, tp)`` mesh (see ``_fsdp2_worker``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from tests.trainer_client._fsdp2_worker import _job as fsdp2_job
from tests.trainer_client._fsdp2_worker import mesh_args
from tests.trainer_client._torchrun import exit_worker
from trainer_client.dcp import DaemonReader, DaemonWriter


class AppState(Stateful):
    """The DCP tutorial's wrapper: model and optimizer state as one Stateful leaf."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _job(tp: int = 1, cuda: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """test_fsdp2's job, with an LR scheduler (a Stateful leaf DCP calls for itself)."""
    model, opt, _ = fsdp2_job(tp, cuda=cuda)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in model.state_dict().items():
        out[f"model/{k}"] = v.full_tensor().cpu()
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"optim/{pid}/{k}"] = (v.full_tensor() if hasattr(v, "full_tensor") else v.clone()).cpu()
    return out


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, step: int, tp: int = 1) -> None:
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank() // tp)  # a tp group sees one batch
    device = next(model.parameters()).device
    model(torch.randn(16, 24, generator=gen).to(device)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def _refusal(save: Any) -> str:
    try:
        save()
    except BaseException as exc:  # noqa: BLE001 - DCP wraps the writer's error in a BaseException; its text counts
        return str(exc)
    return "accepted"


def main() -> None:
    argv, shape = mesh_args(sys.argv)
    tp, cuda = shape.get("tp", 1), shape.get("cuda", 0)
    mode, sock, out = argv[1], argv[2], argv[3]
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")  # async_save needs a CPU backend
    model, opt, sched = _job(tp, cuda)
    state = {"app": AppState(model, opt), "sched": sched, "progress": {"step": 0, "tokens": [0, 1.5]}}
    if mode == "save":
        writer = DaemonWriter("dcp-job", socket_path=sock)
        steps, steady = int(argv[4]), "steady" in argv[5:]
        refusals = []
        if steady:  # no_dist before any full save: the writer has no job plan to reuse
            refusals.append(_refusal(lambda: dcp.save(state, storage_writer=writer, checkpoint_id=1, no_dist=True)))
        for step in range(1, steps + 1):
            _train_step(model, opt, sched, step, tp)
            state["progress"] = {"step": step, "tokens": [step * 16, 1.5]}
            if step < steps or steady:
                # steady: every save after the first without DCP's collectives, on the first's plan
                dcp.save(state, storage_writer=writer, checkpoint_id=f"checkpoint/step-{step}", no_dist=steady and step > 1)
            else:
                dcp.async_save(state, storage_writer=writer, checkpoint_id=f"checkpoint/step-{step}").result()
        if steady:  # a state with an entry more than the plan's
            refusals.append(
                _refusal(lambda: dcp.save({**state, "extra": torch.ones(3)}, storage_writer=writer, checkpoint_id=steps + 1, no_dist=True))
            )
        writer.wait()
        writer.close()
        result = {"full": _full(model, opt), "sched": sched.state_dict(), "progress": state["progress"], "refusals": refusals}
    else:
        reader = DaemonReader("dcp-job", socket_path=sock)
        dcp.load(state, storage_reader=reader)  # the newest step the whole job can load
        result = {"full": _full(model, opt), "sched": sched.state_dict(), "progress": state["progress"], "step": reader.step}
        reader.close()
        if len(argv) > 4 and argv[4] == "--then":  # the new world saves a step; it must be loadable
            writer = DaemonWriter("dcp-job", socket_path=sock)
            nxt = int(state["progress"]["step"]) + 1
            _train_step(model, opt, sched, nxt, tp)
            state["progress"] = {"step": nxt, "tokens": [nxt * 16, 1.5]}
            dcp.save(state, storage_writer=writer, checkpoint_id=nxt)
            writer.wait()
            writer.close()
            result["then"] = _full(model, opt)
    if dist.get_rank() == 0:
        torch.save(result, out)
    dist.barrier()  # no rank tears its process group down while another still writes its result
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_worker()
