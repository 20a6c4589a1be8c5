"""Validation of the names and steps that arrive from workers and peers (they become paths): the
limits every ffplane process shares (``dataserver.protocol.limits``)."""

from __future__ import annotations

from dataserver.protocol.limits import MAX_STEP, NAME_PATTERN, check_name, check_step

__all__ = ["MAX_STEP", "NAME_PATTERN", "check_name", "check_step"]
