"""examples/train_plain.py's job (same model, data path and torch.save every K steps, by rank 0,
to a directory standing in for shared storage), with the recovery timeline events ffplane's
library emits (restored, data_ready, saved) so bench/recovery.py times both sides alike.
torchrun ... _plain_job.py --data F --out D --steps N --save-every K
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
from pathlib import Path

import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from train_plain import GPT, batches  # noqa: E402

from trainer_client.events import emit  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--job", default="")  # accepted so the harness can launch either script alike
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    # a collective stuck on a peer that died unnoticed fails after a minute (default: 30) and
    # torchrun restarts the job, instead of waiting half an hour
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    tokens = torch.tensor(pq.read_table(args.data)["tokens"].to_pylist())
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(TensorDataset(tokens), world, rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(TensorDataset(tokens), batch_size=args.batch, sampler=sampler, drop_last=True)
    ckpt = os.path.join(args.out, "checkpoint.pt")
    saved = torch.load(ckpt) if os.path.exists(ckpt) else None
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
        emit("restored", step=saved["step"], source="disk")
    else:
        emit("restored", step=-1, source="none")  # nothing on disk yet: from the start
    first = True
    for step, batch in batches(loader, sampler, saved["step"] + 1 if saved else 0):
        if first:
            emit("data_ready", step=step)
            first = False
        x = batch["tokens"].long() % 512
        loss = nn.functional.cross_entropy(ddp(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step + 1) % args.save_every == 0:
            tmp = ckpt + ".tmp"  # a rank killed mid-save must not leave a torn checkpoint
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, ckpt)
        emit("saved", step=step)  # "step done", as ffplane's save marks it
        if step == args.steps - 1:
            break
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(args.out, "final.pt"))
    del ddp  # DDP before its process group: freeing the group from DDP's destructor, which holds
    gc.collect()  # the GIL, can deadlock with gloo's worker thread (pytorch/pytorch#56297)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
