"""The one rule for which generation of its job a step is planned in: the newest generation
starting at or before it (a job's plan changes only by gaining a generation, from its
``start_step`` on). The node daemon applies it to the steps it cached, the DataLoader to steps it
read straight from the data server; both from the data server's job view."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from ffplane_contract.dataserver_http import JobView

STALE, CURRENT, AHEAD = -1, 0, 1  # a file against the plan: planned before it, in it, after it


@dataclass(frozen=True)
class JobPlan:
    """The start steps of a job's generations, ascending (the first is 0)."""

    starts: tuple[int, ...]

    @classmethod
    def from_view(cls, view: JobView) -> JobPlan:
        """The plan of a data server's job view; ValueError for a view that is not one."""
        if not view.generations:
            raise ValueError(f"job {view.name!r}'s view has no generations")
        starts = sorted(g.start_step for g in view.generations)
        if starts[0] != 0:
            raise ValueError(f"a job whose first generation starts at step {starts[0]}, not 0")
        return cls(tuple(starts))

    def generation(self, step: int) -> int:
        """The generation (its start step) ``step`` is planned in."""
        return self.starts[bisect.bisect_right(self.starts, step) - 1]

    def compare(self, first: int, generations: Sequence[int] | None) -> int:
        """A file of ``len(generations)`` steps from ``first``, tagged ``generations``, against this
        plan: ``STALE`` if a step was planned before the generation it is in now, else ``AHEAD`` if
        one was planned in a generation this plan lacks, else ``CURRENT`` (also for untagged files)."""
        if generations is None:
            return CURRENT
        verdict = CURRENT
        for step, got in enumerate(generations, first):
            want = self.generation(step)
            if got < want:
                return STALE
            if got > want:
                verdict = AHEAD
        return verdict
