"""Every random number generator a training script draws from, as one Stateful leaf.

Seeded per rank (as nanoGPT and most data-parallel scripts do), these states differ across the
dp group, so save them under a private key::

    ckpt = Checkpointer(job, layout, private_keys=("rng",))
    ckpt.save(step, {"model": ..., "optim": ..., "rng": RngState()})
    ckpt.restore(into={..., "rng": RngState()})   # sets every generator back

Covered: torch's CPU generator, every CUDA device's (when CUDA is up), numpy's global
generator (when numpy is imported) and Python's ``random``. Tensors and JSON only: no pickle.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch


class RngState:
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        version, internal, gauss = random.getstate()
        state["random"] = {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss}
        np = sys.modules.get("numpy")
        if np is not None:
            kind, keys, pos, has_gauss, cached = np.random.get_state()
            state["numpy"] = {
                "kind": kind,
                "keys": torch.from_numpy(keys.astype("int64")),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached": float(cached),
            }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        r = state["random"]
        random.setstate((r["version"], tuple(int(x) for x in r["state"].tolist()), r["gauss"]))
        if "numpy" in state:
            import numpy as np

            n = state["numpy"]
            np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
