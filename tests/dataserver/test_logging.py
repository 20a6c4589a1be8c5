"""Log lines: text for a person (the default on a terminal), JSON with ISO times for a collector;
each names the component."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from ffplane_runtime.httpserver import JsonLogFormatter, TextLogFormatter
from tests._servers import start


def _record() -> logging.LogRecord:
    record = logging.makeLogRecord(
        {"name": "statestore.ring", "levelname": "WARNING", "msg": "replication failed", "created": 1795500000.25}
    )
    record.__dict__.update({"job": "j1", "step": 7})
    return record


def test_json_lines_carry_an_iso_time_and_the_component() -> None:
    line = json.loads(JsonLogFormatter("statestore").format(_record()))
    assert line["ts"] == "2026-11-24T06:00:00.250Z" and line["component"] == "statestore"
    assert line["msg"] == "replication failed" and line["job"] == "j1" and line["step"] == 7


def test_text_lines_read_as_a_sentence_with_fields() -> None:
    text = TextLogFormatter("statestore").format(_record())
    assert re.fullmatch(r"\d\d:\d\d:\d\d\.250 WARNING statestore  replication failed  job=j1 step=7", text), text


def test_a_server_asked_for_text_logs_writes_text(tmp_path: Path, data_dir: Path) -> None:
    proc = start("dataserver", ["serve", "--data-dir", str(data_dir), "--port", "0", "--log-format", "text"], tmp_path, "ds")
    try:
        proc.stop()
    finally:
        proc.kill()
    lines = [ln for ln in proc.log().splitlines() if ln.strip()]
    assert lines and not any(ln.startswith("{") for ln in lines)
    assert any(" dataserver  " in ln for ln in lines)
