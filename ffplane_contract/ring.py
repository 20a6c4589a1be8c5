"""The replication ring's one rule: the alive members in node-id order, each replicating its
commits to the next one, the last to the first.

The coordinator applies it to every node's successor and sends it in its ring view; a daemon uses
the successor it is sent, and applies the same rule itself only to a member list it has brought up
to date from membership events (a UDP answer carries the events, not the successor).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence


def successor(ring: Sequence[str], node_id: str) -> str | None:
    """The node ``node_id`` replicates to, given ``ring``: the alive members sorted by node id.

    The member after it, wrapping around; None when it has no other member to go to. A node out
    of the ring while it still beats (the coordinator found its peer port unreachable) has one
    too: the member that would follow it. Its own commits still go out, so a node nobody reaches
    that is then lost does not take its newest state with it.
    """
    after = bisect_right(ring, node_id)  # members sorting after node_id start here
    member = after > 0 and ring[after - 1] == node_id
    if len(ring) < (2 if member else 1):
        return None
    return ring[after % len(ring)]


def parity_group(ring: Sequence[str], node_id: str, k: int) -> tuple[str, ...]:
    """The members whose shards are XORed together with ``node_id``'s (parity replicas, ``k``
    per group): ``ring`` cut in runs of ``k`` in node-id order, the last run shorter. A ring of
    ``k`` members or fewer, or a node out of it, has no parity group: ``(node_id,)`` alone, whose
    "parity" is a whole replica on its successor."""
    if node_id not in ring or len(ring) <= k:
        return (node_id,)
    start = ring.index(node_id) // k * k
    return tuple(ring[start : start + k])


def parity_holder(ring: Sequence[str], node_id: str, k: int) -> str | None:
    """The node holding the parity of ``node_id``'s group: the member after the group's last,
    wrapping around (never one of the group: the ring has more than ``k`` members). With no
    group, the ring successor (a whole replica)."""
    group = parity_group(ring, node_id, k)
    if len(group) == 1 and (node_id not in ring or len(ring) <= k):
        return successor(ring, node_id)
    return ring[(ring.index(group[-1]) + 1) % len(ring)]
