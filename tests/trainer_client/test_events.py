"""Timeline events: records of the ``ffplane.timeline`` logger, built only for an attached
handler; the harness's handler writes the event files the demo, soak and benchmarks read."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ffplane_harness import timeline as harness_timeline
from ffplane_harness.timeline import attach_timeline, batch_digest, detach_timeline
from tests._servers import TOKEN, Proc
from tests.conftest import create_job
from trainer_client import DataLoader
from trainer_client.events import TIMELINE_LOGGER, TimelineEvent, emit, enabled


def _lines(directory: Path) -> list[dict[str, object]]:
    return [json.loads(line) for f in sorted(directory.glob("events-*.jsonl")) for line in f.read_text().splitlines()]


class _Records(logging.Filter):
    """Counts the records the library builds (a logger's filter sees each one it logs)."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.kinds.append(record.getMessage())
        return True


@pytest.fixture
def records(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Records]:
    """The records the library builds on the timeline logger (its filter sees each one)."""
    logger = logging.getLogger(TIMELINE_LOGGER)
    seen = _Records()
    logger.addFilter(seen)
    yield seen
    logger.removeFilter(seen)


def _bare(monkeypatch: pytest.MonkeyPatch) -> None:
    """Set aside the handlers pytest's log capture attaches, at each test phase, to every logger
    that does not propagate (so from the test's body)."""
    monkeypatch.setattr(logging.getLogger(TIMELINE_LOGGER), "handlers", [])


def test_no_handler_no_record_and_the_root_logger_prints_none(records: _Records, monkeypatch: pytest.MonkeyPatch) -> None:
    _bare(monkeypatch)
    root = logging.getLogger()
    printed = _Records()
    handler = logging.NullHandler()
    handler.addFilter(printed)
    monkeypatch.setattr(root, "handlers", [handler])  # a script's logging.basicConfig(level=DEBUG)
    level = root.level
    root.setLevel(logging.DEBUG)
    try:
        assert not enabled() and not enabled(logging.DEBUG)
        emit("saved", step=1)
    finally:
        root.setLevel(level)
    assert records.kinds == [] and printed.kinds == []


def test_the_harness_handler_writes_each_event_after_process_start(
    tmp_path: Path, records: _Records, monkeypatch: pytest.MonkeyPatch
) -> None:
    _bare(monkeypatch)
    handler = attach_timeline(tmp_path, batches=False)
    try:
        assert enabled() and not enabled(logging.DEBUG)
        emit("restored", step=3, source="local")
        emit("batch", logging.DEBUG, step=4, batch={"x": torch.zeros(2)})  # left out: batches=False
        emit("saved", step=4)
    finally:
        detach_timeline(handler)
    emit("saved", step=5)  # detached: nothing
    lines = _lines(tmp_path)
    assert [e["kind"] for e in lines] == ["process_start", "restored", "saved"]
    assert lines[1]["step"] == 3 and lines[1]["source"] == "local" and lines[2]["step"] == 4
    assert all(isinstance(e["t"], float) and "pid" in e and "rank" in e and "node" in e for e in lines)
    assert float(lines[0]["t"]) <= float(lines[1]["t"])  # type: ignore[arg-type]
    assert records.kinds == ["restored", "saved"] and not enabled()


def test_a_record_without_a_timeline_event_is_not_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _bare(monkeypatch)
    handler = attach_timeline(tmp_path)
    try:
        logging.getLogger(TIMELINE_LOGGER).info("free text")
        logging.getLogger(TIMELINE_LOGGER).info("saved", extra={"timeline": TimelineEvent("saved", {"step": 1})})
    finally:
        detach_timeline(handler)
    assert [e["kind"] for e in _lines(tmp_path)] == ["process_start", "saved"]


def test_batch_digest_is_of_what_the_loop_got() -> None:
    a = {"tokens": torch.arange(6).reshape(2, 3), "img": [memoryview(b"ab"), memoryview(b"c")]}
    same = {"tokens": torch.arange(6).reshape(3, 2).t().contiguous().t().reshape(2, 3).clone(), "img": [b"ab", b"c"]}
    assert batch_digest(a) == batch_digest(same)
    assert batch_digest(a) != batch_digest({**a, "img": [b"a", b"bc"]})  # values' bounds count
    assert batch_digest(a) != batch_digest({**a, "tokens": a["tokens"] + 1})


def test_the_dataloader_builds_no_record_and_no_digest_without_a_handler(
    tmp_path: Path, dataserver: Proc, records: _Records, monkeypatch: pytest.MonkeyPatch
) -> None:
    _bare(monkeypatch)
    create_job(dataserver, max_steps=8)
    digests: list[str] = []
    real = harness_timeline.batch_digest
    monkeypatch.setattr(harness_timeline, "batch_digest", lambda b: digests.append(real(b)) or digests[-1])
    events = tmp_path / "events"

    def read(start: int) -> list[str]:
        loader = DataLoader("j1", 0, dataserver=dataserver.url, token=TOKEN, socket_path=tmp_path / "absent.sock", start_step=start)
        try:
            return [batch_digest(b) for b in loader]
        finally:
            loader.close()

    plain = read(0)
    assert len(plain) == 8 and records.kinds == [] and digests == [] and not events.exists()

    handler = attach_timeline(events)
    try:
        watched = read(5)
    finally:
        detach_timeline(handler)
    lines = _lines(events)
    assert [e["kind"] for e in lines] == ["process_start", "data_ready"] + ["batch"] * 3
    assert [e["step"] for e in lines if e["kind"] == "batch"] == [5, 6, 7]
    # the harness digested the very batches the loop got
    assert [e["digest"] for e in lines if e["kind"] == "batch"] == digests == watched == plain[5:]
