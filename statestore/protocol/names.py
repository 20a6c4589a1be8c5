"""Validation of the names and steps that arrive from workers and peers (they become paths)."""

from __future__ import annotations

import re

# jobs and roles, as the data server names jobs; the peer API's path parameters use the same
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
MAX_STEP = (1 << 63) - 1
_NAME = re.compile(NAME_PATTERN)


def check_step(value: object) -> int:
    step = int(value)  # type: ignore[call-overload]
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be in 0..2^63-1, got {step}")
    return step


def check_name(value: object) -> str:
    name = str(value)
    if not _NAME.match(name):
        raise ValueError(f"invalid name {name!r}: names must match {NAME_PATTERN}")
    return name
