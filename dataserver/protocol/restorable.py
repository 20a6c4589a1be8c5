"""The one rule for which step a job can restore: the newest step at which every role of the
job's layout has a copy. The coordinator applies it to its members' inventories, the daemon to
its own slots and to the durable tier; each then checks the candidates' checksums its own way,
newest first.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping


def whole_steps(copies: Mapping[str, Iterable[int]], roles: Collection[str], below: int | None = None) -> list[int]:
    """The steps (newest first, only those under ``below``) at which every role in ``roles`` has
    a copy in ``copies`` (role → its steps). None at all when ``roles`` is empty: a job that
    names no role has nothing whole."""
    if not roles or any(r not in copies for r in roles):
        return []
    common = set.intersection(*(set(copies[r]) for r in roles))
    return sorted((s for s in common if below is None or s < below), reverse=True)


def restorable_step(copies: Mapping[str, Iterable[int]], roles: Collection[str], below: int | None = None) -> int | None:
    """The newest of ``whole_steps``, or None."""
    steps = whole_steps(copies, roles, below)
    return steps[0] if steps else None
