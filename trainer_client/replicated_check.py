"""The check that state saved as replicated really is the same on every rank of the dp group.

The razor saves ``1/dp`` of the replicated bytes per rank and a restore hands every rank the
group's one copy. State that differs per rank (an RNG seeded per rank, a per-rank data position)
saved without ``private_keys`` would come back as another rank's, silently. So on its first save
a Checkpointer hashes each top-level key's replicated tensor bytes and the ranks compare them
(one all_gather of a few int64s); a key that differs raises ``StateError`` naming it.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer_client.razor import Layout
from trainer_client.state_codec import StateError, encode


def key_digests(state: Any, private_keys: frozenset[str], layout: Layout | None = None) -> dict[str, int]:
    """Top-level key → XXH3 of the tensor bytes it would put in the replicated stream. (JSON
    leaves are not compared: each rank's shard header carries its own tree, so they come back
    per rank anyway.)"""
    import xxhash

    if not isinstance(state, dict):
        return {}
    out = {}
    for key in sorted(str(k) for k in state):
        if key in private_keys:
            continue
        enc = encode({key: state[key] if key in state else state[int(key)]}, layout=layout)
        h = xxhash.xxh3_64()
        for entry, source in zip(enc.storages, enc.sources):
            if entry.stream == "replicated":
                h.update(source.cpu().numpy().data)  # once, on the first save
        out[key] = h.intdigest() & ((1 << 62) - 1)  # an int64 for the collective
    return out


def check_replicated(state: Any, private_keys: frozenset[str], layout: Layout, group: Any) -> None:
    """Raise ``StateError`` naming the keys whose replicated bytes differ within the dp group."""
    if group is None:  # one process: nothing to compare with
        return
    import torch.distributed as dist

    digests = key_digests(state, private_keys, layout)
    keys = sorted(digests)
    mine = torch.tensor([layout.pp_rank, layout.tp_rank, len(keys), *[digests[k] for k in keys]], dtype=torch.int64)
    width = torch.tensor([mine.numel()], dtype=torch.int64)
    cuda = dist.get_backend(group) == "nccl"  # NCCL moves device tensors only
    if cuda:
        mine, width = mine.cuda(), width.cuda()
    dist.all_reduce(width, op=dist.ReduceOp.MAX, group=group)
    padded = torch.full((int(width.item()),), -1, dtype=torch.int64, device=mine.device)
    padded[: mine.numel()] = mine
    gathered = [torch.empty_like(padded) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, padded, group=group)
    peers = [g.cpu().tolist() for g in gathered]
    same_group = [p for p in peers if p[0] == layout.pp_rank and p[1] == layout.tp_rank]
    if any(p[2] != len(keys) for p in same_group):
        raise StateError(
            f"the ranks of the dp group save states with different top-level keys (here: {keys}); every rank must save the same structure"
        )
    differ = [k for i, k in enumerate(keys) if len({p[3 + i] for p in same_group}) > 1]
    if differ:
        raise StateError(
            f"state keys {differ} differ across the dp group but are saved as replicated (one copy for the whole group): "
            f"a restore would hand every rank one rank's values. Pass private_keys={tuple(differ)!r} to the Checkpointer "
            "(per-rank RNG state: trainer_client.RngState under a private key)"
        )
