"""ffplane data server: dataset catalog, deterministic planner, batch streaming over HTTP."""

from dataserver.planner import Generation, Planner, StepPlan

__all__ = sorted(["Generation", "Planner", "StepPlan"])
