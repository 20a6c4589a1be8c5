"""Timeline events: written only where asked, and only the kinds not skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer_client.events import EVENTS_ENV, SKIP_ENV, emit, events_on


def _kinds(directory: Path) -> list[str]:
    return [json.loads(line)["kind"] for f in sorted(directory.glob("events-*.jsonl")) for line in f.read_text().splitlines()]


def test_events_are_written_only_when_asked_and_skipped_kinds_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EVENTS_ENV, raising=False)
    monkeypatch.delenv(SKIP_ENV, raising=False)
    emit("saved", step=1)
    assert not events_on() and not list(tmp_path.iterdir())
    monkeypatch.setenv(EVENTS_ENV, str(tmp_path))
    monkeypatch.setenv(SKIP_ENV, "batch,data_ready")
    assert events_on() and events_on("saved") and not events_on("batch")
    emit("batch", step=1, digest="x")
    emit("saved", step=1)
    assert _kinds(tmp_path)[-1] == "saved" and "batch" not in _kinds(tmp_path)
    monkeypatch.delenv(SKIP_ENV)
    emit("batch", step=2, digest="y")
    assert _kinds(tmp_path)[-1] == "batch"
