"""A small GPT-style DDP job as most are written today: torch DataLoader + DistributedSampler
over a local token file, torch.save to disk every K steps.  torchrun ... train_plain.py --data F --out D
"""

import argparse
import datetime
import gc
import os

import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class GPT(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 64, heads: int = 4, layers: int = 2, seq: int = 64) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(n))
        return self.head(self.blocks(h, mask=self.mask[:n, :n], is_causal=True))


def batches(loader: DataLoader, sampler: DistributedSampler, start: int):  # type: ignore[no-untyped-def]
    """(step, batch) from ``start`` on, skipping what the checkpoint already trained on."""
    step = 0
    for epoch in range(1 << 30):
        sampler.set_epoch(epoch)
        for (x,) in loader:
            if step >= start:
                yield step, {"tokens": x}
            step += 1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--save-every", type=int, default=10)
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
    sampler = DistributedSampler(TensorDataset(tokens), world, rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(TensorDataset(tokens), batch_size=args.batch, sampler=sampler, drop_last=True)
    ckpt = os.path.join(args.out, "checkpoint.pt")
    saved = torch.load(ckpt) if os.path.exists(ckpt) else None  # the last checkpoint on disk
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
    for step, batch in batches(loader, sampler, saved["step"] + 1 if saved else 0):
        x = batch["tokens"].long() % 512
        loss = nn.functional.cross_entropy(ddp(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step + 1) % args.save_every == 0:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, ckpt)
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
        if step == args.steps - 1:
            break
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(args.out, "final.pt"))
    del ddp  # DDP before its process group: freeing the group from DDP's destructor, which holds
    gc.collect()  # the GIL, can deadlock with gloo's worker thread (pytorch/pytorch#56297)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
