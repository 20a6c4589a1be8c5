"""The states bench/peers.py saves with every system, built alike in every rank process.

``gpt_ddp``: the example GPT (examples/train_ffplane.py) under DDP on 2 ranks, trained one step
between saves, so its step time with a save every step can be compared with none. ``fsdp2``: an
MLP's weights and AdamW moments sharded by FSDP2 over 2 ranks (``--fsdp2-mib`` in all).
``single``: ``--single-mib`` of model + optimizer tensors held by one rank.

A state has two forms: ``dcp`` (what ``get_state_dict`` gives: DTensors where FSDP2 shards, the
form DCP writers take) and ``local`` (every DTensor as its local shard, plain tensors: the form a
rank-local saver such as ``torch.save`` takes). Both are views of the live tensors.

Between saves a "step" changes every tensor (the trained GPT; a stamp of the step number in each
tensor's first element otherwise), and ``digest`` fingerprints the live local bytes, so a restore
is checked against the digest the saving process recorded for the step it claims to hold.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

STATES = ("gpt_ddp", "fsdp2", "single")
WORLD = {"gpt_ddp": 2, "fsdp2": 2, "single": 1}


def leaves(node: Any) -> list[torch.Tensor]:
    """Every tensor in a nested dict/list state, in a fixed order (DTensors as local shards)."""
    if isinstance(node, torch.Tensor):
        return [node.to_local() if hasattr(node, "to_local") else node]
    if isinstance(node, dict):
        return [t for k in sorted(node, key=str) for t in leaves(node[k])]
    if isinstance(node, (list, tuple)):
        return [t for v in node for t in leaves(v)]
    return []


def local_form(node: Any) -> Any:
    """The same state with every DTensor replaced by its local shard (a view)."""
    if isinstance(node, torch.Tensor):
        return node.to_local() if hasattr(node, "to_local") else node
    if isinstance(node, dict):
        return {k: local_form(v) for k, v in node.items()}
    if isinstance(node, list):
        return [local_form(v) for v in node]
    return node


def digest(state: Any) -> str:
    """XXH3 of every local tensor's bytes, in order (as the daemon checksums shards)."""
    from ffplane_contract.checksum import streaming_checksum

    h = streaming_checksum()
    for t in leaves(state):
        h.update(memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


@dataclass
class State:
    """A live training state: ``step()`` changes it as a training step would."""

    name: str
    dcp: dict[str, Any]
    nbytes: int  # this rank's local bytes
    _step: Any = field(repr=False, default=None)
    replicated: bool = False  # every rank holds the same state (DDP): a razor may split it

    @property
    def local(self) -> dict[str, Any]:
        return local_form(self.dcp)

    def step(self, n: int) -> None:
        self._step(n)


def _stamp(state: dict[str, Any]) -> Any:
    tensors = leaves(state)

    def step(n: int) -> None:
        for t in tensors:
            t.view(-1)[0] = n

    return step


def _single(mib: int) -> State:
    per = (mib << 20) // 18 // 4
    g = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(16)}
    model["emb.bf16"] = torch.randn(per * 2, generator=g).to(torch.bfloat16)
    state = {"model": model, "optim": {"step_counts": torch.arange(per // 2, dtype=torch.int64)}}
    return State("single", state, sum(t.nbytes for t in leaves(state)), _stamp(state))


def _fsdp2(mib: int) -> State:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from bench._dcp_job import fsdp2_job

    model, opt, _ = fsdp2_job(mib)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    return State("fsdp2", state, sum(t.nbytes for t in leaves(state)), _stamp(state))


def _gpt_ddp() -> State:
    from torch.nn.parallel import DistributedDataParallel as DDP
    from train_ffplane import GPT

    torch.manual_seed(0)
    model = GPT()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    data = torch.randint(0, 512, (32, 65), generator=g)  # batch 32 of 64 tokens, as the example job

    def step(n: int) -> None:
        x = data.roll(n, 0)
        loss = torch.nn.functional.cross_entropy(ddp(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()

    step(0)  # AdamW's moments exist, so every save holds the whole state
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    return State("gpt_ddp", state, sum(t.nbytes for t in leaves(state)), step, replicated=True)


def build(name: str, fsdp2_mib: int, single_mib: int) -> State:
    if name == "gpt_ddp":
        return _gpt_ddp()
    if name == "fsdp2":
        return _fsdp2(fsdp2_mib)
    if name == "single":
        return _single(single_mib)
    raise ValueError(f"unknown state {name!r}; choose from {STATES}")
