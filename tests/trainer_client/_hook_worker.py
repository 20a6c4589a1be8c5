"""One rank of a small DDP job for test_link_hints: trains 4 steps with the given bucket size and
comm hook, counts all-reduce calls and the step hook's plans, writes its final weights.
python _hook_worker.py RANK WORLD INIT_FILE HINTS_ROOT BUCKET_MB HOOK OUT"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer_client import LinkHints, link_hints  # noqa: E402

plans = [0]


class _CountedPlan(link_hints._Plan):
    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        plans[0] += 1


link_hints._Plan = _CountedPlan  # type: ignore[misc]  # how often the step hook laid out its buffers


def main() -> None:
    rank, world, init, root, bucket_mb, hook, out = sys.argv[1:8]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=int(rank), world_size=int(world))
    calls = [0]
    real = dist.all_reduce

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return real(*args, **kwargs)

    dist.all_reduce = counted
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    ddp = DDP(model, bucket_cap_mb=float(bucket_mb))
    hints = LinkHints(socket_path=Path(root) / "daemon.sock")
    if hook == "step":
        ddp.register_comm_hook(None, hints.ddp_comm_hook(ddp))
    elif hook == "buckets":
        ddp.register_comm_hook(None, hints.ddp_comm_hook(ddp, reproducible=False))
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(100 + int(rank))
    for _ in range(4):
        x = torch.randn(32, 64, generator=gen) * (1 + 30 * torch.rand(32, 64, generator=gen))  # wide range: sums depend on order
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.save({"calls": calls[0], "plans": plans[0], "weights": [p.detach().clone() for p in model.parameters()]}, out)
    hints.close()
    # DDP before its process group, and collected now (the comm hook's state keeps it in a cycle):
    # freed at interpreter exit instead, after the group, a rank died with "terminate called
    # without an active exception" (as the examples do, pytorch/pytorch#56297)
    del ddp
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
