"""The same job on ffplane: batches from the node's cache, state saved every step in shared memory
(replicated to the next node), restored wherever a rank lands.  torchrun ... train_ffplane.py --job J --out D
"""

import argparse
import datetime
import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer_client import Checkpointer, DataLoader, Layout, LinkHints


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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=60)
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
    ddp.register_comm_hook(None, LinkHints().ddp_comm_hook(ddp))  # STATE traffic waits for these
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    loader = DataLoader(args.job, rank)  # batch size and shuffle: the job's, on the data server
    ckpt = Checkpointer(args.job, Layout(dp=world, dp_rank=rank))
    saved = ckpt.restore()  # the newest step every rank saved, from this node or another
    if saved is not None:
        model.load_state_dict(saved.state["model"])
        opt.load_state_dict(saved.state["optim"])
        loader.load_state_dict(saved.state["loader"])
    for batch in loader:
        step = loader.next_step - 1
        x = batch["tokens"].long() % 512
        loss = nn.functional.cross_entropy(ddp(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict(), "loader": loader.state_dict()})
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
