"""examples/train_ffplane.py, unchanged, with one part of ffplane's per-step work switched off or
swapped, for bench/step_cost.py. ``FFPLANE_ABLATE``:

* ``per_tensor`` — the reproducible comm hook without the model: one all-reduce per gradient;
* ``buckets`` — the comm hook with DDP's own bucket all-reduce (not bitwise-stable on restore);
* ``no_hook`` — no comm hook at all (DDP's default; no link hints, no wait for the last save);
* ``no_save`` — the comm hook, but ``Checkpointer.save`` only marks the step done.

Kinds combine with ``+``: ``no_save+no_hook`` is ffplane's data path alone (batches from the node
cache, nothing else of ffplane).
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer_client import Checkpointer, LinkHints  # noqa: E402
from trainer_client.events import emit  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_ffplane.py"


def _ablate(kind: str) -> None:
    hook = LinkHints.ddp_comm_hook
    if kind == "per_tensor":
        LinkHints.ddp_comm_hook = lambda self, model=None, reproducible=True: hook(self, None, True)  # type: ignore[method-assign]
    elif kind == "buckets":
        LinkHints.ddp_comm_hook = lambda self, model=None, reproducible=True: hook(self, model, False)  # type: ignore[method-assign]
    elif kind == "no_hook":
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        LinkHints.ddp_comm_hook = lambda self, model=None, reproducible=True: (
            lambda pg, bucket: allreduce_hook(pg or dist.group.WORLD, bucket)
        )  # type: ignore[method-assign]
    elif kind == "no_save":

        def mark(self: Checkpointer, step: int, state: Any) -> bool:
            emit("saved", step=step)
            return True

        Checkpointer.save = mark  # type: ignore[method-assign]
    elif kind:
        raise SystemExit(f"unknown FFPLANE_ABLATE={kind!r}; expected per_tensor, buckets, no_hook or no_save")


if __name__ == "__main__":
    for kind in os.environ.get("FFPLANE_ABLATE", "").split("+"):
        _ablate(kind)
    sys.argv[0] = str(EXAMPLE)
    runpy.run_path(str(EXAMPLE), run_name="__main__")
