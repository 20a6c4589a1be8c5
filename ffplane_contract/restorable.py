"""The one rule for which step a job can restore: the newest step at which every role of the
layout *that step was saved with* has a copy. The coordinator applies it to its members'
inventories, the daemon to its own slots and to the durable tier; each then checks the
candidates' checksums its own way, newest first.

The layout is per step because a job's parallel shape can change (a dp 4 → 2 restart through a
resharding load): the roles of the old layout keep their old shards, and must not stop the new
layout's steps from being whole. Each copy names its layout's roles (``layout_roles`` in its
header); a step's layout is the union of what its copies name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class Layouts:
    """Step → the roles its copies name, gathered copy by copy."""

    def __init__(self) -> None:
        self.roles: dict[int, set[str]] = {}

    def add(self, step: int, roles: Iterable[str]) -> None:
        self.roles.setdefault(step, set()).update(roles)

    def of(self, step: int) -> set[str]:
        return self.roles.get(step, set())


def whole_steps(copies: Mapping[str, Iterable[int]], layouts: Layouts, below: int | None = None) -> list[int]:
    """The steps (newest first, only those under ``below``) at which every role of the step's
    layout has a copy in ``copies`` (role → its steps). A step whose copies name no role is never
    whole."""
    held = {r: set(steps) for r, steps in copies.items()}
    out = []
    for step, roles in layouts.roles.items():
        if (below is None or step < below) and roles and all(step in held.get(r, ()) for r in roles):
            out.append(step)
    return sorted(out, reverse=True)


def restorable_step(copies: Mapping[str, Iterable[int]], layouts: Layouts, below: int | None = None) -> int | None:
    """The newest of ``whole_steps``, or None."""
    steps = whole_steps(copies, layouts, below)
    return steps[0] if steps else None
