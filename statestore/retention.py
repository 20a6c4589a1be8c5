"""How many copies of each role's shard a daemon keeps, here and on its ring successor, and
what failure that survives (docs/decisions.md, "Two slots and two replica files per role").

A role keeps ``versions`` committed versions (``--versions``, 2 by default) in as many slots on
its node, and its ring successor as many replica files. A new save overwrites the oldest slot,
and a new replica lands in the oldest replica's file, as soon as no role of the job can need
that version for the restorable step. A *settled* save proves it: every rank's previous save
was answered (committed and replicated) before a collective this rank then passed
(``trainer_client.settle_all``, which the DDP comm hook calls), so every role holds a replica of
its previous save and none needs anything older than this role's newest. An unsettled save only
knows its own previous save is answered; another role may still be one save behind, so it keeps
one more version on each side, in a slot or file of its own.
"""

from __future__ import annotations

from typing import Final

DEFAULT_VERSIONS: Final = 2
# One version cannot survive a node loss: a node lost while its push is in flight leaves its
# roles' only replica half-overwritten, and its own copy is gone with it.
MIN_VERSIONS: Final = 2
MAX_VERSIONS: Final = 8  # each version is a whole shard of shared memory on two nodes
MAX_PARITY_K: Final = 16  # nodes a parity group XORs together (a lost one is rebuilt from all the others)


def kept_while_writing(versions: int, settled: bool) -> int:
    """Committed versions of a role that stay intact while its next save is written (on its node)
    or while that save's replica arrives (on its successor)."""
    return max(versions - 1, 1 if settled else 2)


def files(versions: int, settled: bool) -> int:
    """Slots a role needs on its node, and replica files on its successor: the versions kept
    while one more is written."""
    return kept_while_writing(versions, settled) + 1


def lost_steps(settled: bool) -> int:
    """The most steps a node loss costs (one worker or daemon kill: at most the save in flight)."""
    return 1 if settled else 2


def survives(replicated: bool, settled: bool, parity_k: int = 0) -> str:
    """What failures a role's copies survive from memory, in words (``/v1/state``)."""
    if not replicated:
        return "worker or daemon kill (no replica: a node loss needs the durable tier)"
    how = f" (rebuilt from its parity group of {parity_k})" if parity_k else ""
    return f"worker or daemon kill, one node loss{how}; at most {lost_steps(settled)} lost step" + (
        "" if settled else "s (saves not settled)"
    )
