"""One rank of a 2-rank gloo job that seeds its RNG per rank, as nanoGPT does (torchrun).

``replicated SOCKET``: saves the RNG state without private_keys, which must raise StateError
naming "rng"; ``private SOCKET OUT``: saves it under private_keys, draws, restores, draws again;
rank 0 writes both draws of each rank to OUT.
"""

from __future__ import annotations

import json
import random
import sys

import numpy as np
import torch
import torch.distributed as dist

from tests.trainer_client._torchrun import exit_worker
from trainer_client import Checkpointer, Layout, RngState, StateError


def main() -> None:
    mode, sock = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1337 + rank)
    random.seed(1337 + rank)
    np.random.seed(1337 + rank)
    model = torch.nn.Linear(4, 4)
    for p in model.parameters():  # the replicated part is the same on every rank
        torch.nn.init.constant_(p, 0.5)
    keys = ("rng",) if mode == "private" else ()
    ckpt = Checkpointer(f"rank-state-{mode}", Layout(dp=world, dp_rank=rank), socket_path=sock, private_keys=keys)
    state = {"model": model.state_dict(), "rng": RngState()}
    if mode == "replicated":
        try:
            ckpt.save(1, state)
        except StateError as exc:
            print(f"refused: {exc}", flush=True)
            assert "'rng'" in str(exc) and "private_keys" in str(exc)
        else:
            raise SystemExit("per-rank RNG state saved as replicated without an error")
    else:
        ckpt.save(1, state)
        ckpt.wait()
        first = [torch.rand(2).tolist(), random.random(), float(np.random.rand())]
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        restored = ckpt.restore(into={"model": model.state_dict(), "rng": RngState()})
        assert restored is not None and restored.step == 1
        again = [torch.rand(2).tolist(), random.random(), float(np.random.rand())]
        draws = [None] * world
        both = torch.tensor([*first[0], first[1], first[2], *again[0], again[1], again[2]], dtype=torch.float64)
        gathered = [torch.empty_like(both) for _ in range(world)]
        dist.all_gather(gathered, both)
        draws = [g.tolist() for g in gathered]
        if rank == 0:
            with open(sys.argv[3], "w") as f:
                json.dump(draws, f)
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_worker()
