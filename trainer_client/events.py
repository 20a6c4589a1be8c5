"""Recovery-timeline events, as records of the named logger ``ffplane.timeline`` (torchft's way:
its ``torchft_commits`` logger). The library says what happened; whoever wants a timeline (the
demo, the chaos soak, the recovery benchmarks: ``ffplane_harness.timeline``) attaches a handler.

Each record's message is the event's kind and ``record.timeline`` a :class:`TimelineEvent` (the
kind and its fields). Kinds, at INFO: ``imported`` (the first of ``trainer_client``'s public
names loaded: the interpreter and torch are), ``restoring`` (a restore called: the process
group, model and DDP are set up), ``restored`` (step, source), ``data_ready`` (the first batch
after start-up is in hand: step), ``saved`` (every save: step). At DEBUG: ``batch`` (every
step's batch as it is handed to the training loop: step, and the batch itself, for a harness
that checks what was trained on).

Off unless asked: the logger does not propagate (a training script's
``logging.basicConfig(level=INFO)`` must not print a line a step), and nothing is built, not
even a record, unless a handler is attached to it and its level lets the kind through.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TIMELINE_LOGGER", "TimelineEvent", "emit", "enabled"]

TIMELINE_LOGGER = "ffplane.timeline"
_timeline = logging.getLogger(TIMELINE_LOGGER)
_timeline.propagate = False  # its own handlers only: the root's would print every event


@dataclass(frozen=True)
class TimelineEvent:
    """One event of the timeline: its kind and fields (``record.timeline`` on its log record)."""

    kind: str
    fields: dict[str, Any] = field(default_factory=dict)


def enabled(level: int = logging.INFO) -> bool:
    """Whether an event at ``level`` reaches a handler: worth working out what it would say."""
    return _timeline.isEnabledFor(level) and _timeline.hasHandlers()


def emit(kind: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log event ``kind`` with ``fields`` (nothing when no handler takes it)."""
    if enabled(level):
        _timeline.log(level, kind, extra={"timeline": TimelineEvent(kind, fields)})
