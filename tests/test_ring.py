"""The replication ring's one rule (``ffplane_contract.ring``), which the coordinator sends and
the daemons apply to member lists they update from membership events."""

from __future__ import annotations

import pytest

from ffplane_contract.ring import successor


@pytest.mark.parametrize(
    ("ring", "node", "expected"),
    [
        ([], "a", None),
        (["a"], "a", None),  # alone: nowhere to replicate to
        (["a", "b", "c"], "a", "b"),
        (["a", "b", "c"], "c", "a"),  # the last wraps to the first
        # out of the ring while beating (its peer port unreachable): where it would be
        (["a", "c"], "b", "c"),
        (["a", "c"], "d", "a"),
        (["a"], "b", "a"),
    ],
)
def test_each_node_replicates_to_the_next_in_node_id_order(ring: list[str], node: str, expected: str | None) -> None:
    assert successor(ring, node) == expected
