"""Validation of the names and steps that arrive from workers and peers (they become paths)."""

from __future__ import annotations


def check_step(value: object) -> int:
    step = int(value)  # type: ignore[call-overload]
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return step


def check_name(value: object) -> str:
    name = str(value)
    if not name or "/" in name or name.startswith(".") or len(name) > 128 or not name.isprintable():
        raise ValueError(f"invalid name {name!r}")
    return name
