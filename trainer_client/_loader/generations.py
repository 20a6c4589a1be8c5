"""The generation check of steps read straight from the data server.

A job's plan changes by gaining a generation (an elastic change from a step on); each batch says
which one it was planned in. Read from the node daemon, a step is the daemon's to check (it owns
the cache that may hold a step planned before the change, the same rule: ``ffplane_contract.plan``). Read from
the data server, a step is planned when it is asked for, but the source asks for several at once:
a step of that read-ahead may predate a generation added since, and one newer than the loader
knows says the job gained one.
"""

from __future__ import annotations

from typing import Any

from ffplane_contract.dataserver_http import JobView
from ffplane_contract.errors import CorruptError
from ffplane_contract.plan import JobPlan
from trainer_client._loader.part import Fetched, Stage
from trainer_client._loader.source import StepSource

_REFETCHES = 2  # a step that still arrives from another generation after this many is refused


def job_plan(job_info: dict[str, Any]) -> JobPlan | None:
    """The plan of the data server's job view (None for a view without generations)."""
    view = JobView.model_validate(job_info)
    return JobPlan.from_view(view) if view.generations else None


class GenerationCheck(Stage[Fetched]):
    """Each step read from the data server is the job's current plan's: one planned in a newer
    generation than the loader knows makes it ask for the job's generations again; one planned in
    an older one is asked for again. Steps from the node daemon pass as they are. No state of its
    own: the job's generations are the data server's, asked for again on a resume."""

    def __init__(self, source: StepSource, plan: JobPlan | None) -> None:
        super().__init__(source)
        self.source = source
        self.plan = plan

    def next(self) -> Fetched:
        item = self.source.next()
        if self.source.name != "dataserver" or self.plan is None:
            return item
        return self._checked(item)

    def _checked(self, item: Fetched) -> Fetched:
        refreshed, refetches = False, 0
        while True:
            assert self.plan is not None
            want = self.plan.generation(item.step)
            if item.generation == want:
                return item
            if not refreshed and item.generation > want:
                self.plan = job_plan(self.source.job_info()) or self.plan  # the job gained one since
                refreshed = True
                continue
            if refetches == _REFETCHES:
                raise CorruptError(
                    f"step {item.step} of job {self.source.job!r} keeps arriving from generation {item.generation}, the job says {want}"
                )
            refetches += 1
            self.source.forget()
            item = self.source.get(item.step)
