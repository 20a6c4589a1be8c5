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
