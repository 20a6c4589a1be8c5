"""A small DDP training job (gloo, CPU) on the ffplane DataLoader and Checkpointer.

Gradients are all-reduced through ffplane's link-hint hook (the gate sees every bucket).
Usage (env RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, FFPLANE_*; FFPLANE_TEST_GLOO_TIMEOUT_S):
    python -m tests.trainer_client._ddp_worker JOB OUT_DIR STEPS
Appends ``step loss.hex()`` to OUT_DIR/losses-RANK.txt each step and, at the end, writes the
SHA-256 of the model weights and optimizer state to OUT_DIR/final-RANK.txt.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer_client import Checkpointer, DataLoader, Layout, LinkHints

VOCAB = 1000


def digest(state: object, h: hashlib._Hash) -> None:
    if isinstance(state, torch.Tensor):
        h.update(state.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    elif isinstance(state, dict):
        for k in sorted(state, key=str):
            h.update(str(k).encode())
            digest(state[k], h)
    elif isinstance(state, (list, tuple)):
        for v in state:
            digest(v, h)
    else:
        h.update(repr(state).encode())


def main() -> None:
    job, out, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    compute_s = float(os.environ.get("FFPLANE_TEST_COMPUTE_S", "0"))
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    # a peer across a cut link must fail the collective soon, as it would on a real cluster
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ.get("FFPLANE_TEST_GLOO_TIMEOUT_S", "60"))))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 32), torch.nn.Flatten(), torch.nn.Linear(32 * 15, VOCAB))
    ddp = DDP(model)
    hints = LinkHints()
    ddp.register_comm_hook(None, hints.ddp_comm_hook(ddp))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    loader = DataLoader(job, rank)
    ck = Checkpointer(job, Layout(dp=world, dp_rank=rank))
    restored = ck.restore()
    if restored is not None:
        print(f"restored step {restored.step} from {restored.source}", flush=True)
        model.load_state_dict(restored.state["model"])
        opt.load_state_dict(restored.state["optim"])
        loader.load_state_dict(restored.state["loader"])
    with open(out / f"losses-{rank}.txt", "a", buffering=1) as losses:
        for batch in loader:
            step = loader.next_step - 1
            x = batch["tokens"].long() % VOCAB
            time.sleep(compute_s)  # the accelerator's compute: the link is idle meanwhile
            loss = torch.nn.functional.cross_entropy(ddp(x[:, :-1]), x[:, -1])
            opt.zero_grad()
            loss.backward()
            opt.step()
            # the loss first: a kill between the two would otherwise leave a committed step whose
            # loss no file holds (the run resumes after it); one re-run instead writes it twice
            losses.write(f"{step} {loss.item().hex()}\n")
            ck.save(step, {"model": model.state_dict(), "optim": opt.state_dict(), "loader": loader.state_dict()})
            if step == steps - 1:
                break
    ck.close()
    hints.close()
    h = hashlib.sha256()
    digest({"model": model.state_dict(), "optim": opt.state_dict()}, h)
    (out / f"final-{rank}.txt").write_text(h.hexdigest())
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
