"""The soak's and benchmarks' reader of worker event files (``ffplane_harness.job_runner``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ffplane_harness.job_runner import _EventLog

INF = float("inf")


def _saved(t: float, rank: int, step: int) -> str:
    return json.dumps({"t": t, "kind": "saved", "rank": rank, "step": step}) + "\n"


def test_saved_steps_come_from_what_each_file_grew_by_in_time_order(tmp_path: Path) -> None:
    job = tmp_path / "j"
    job.mkdir()
    gone = job / "events-999999999.jsonl"  # above any pid_max: its writer is not alive
    gone.write_text(_saved(1.0, 0, 1) + _saved(2.0, 0, 2) + _saved(3.0, 0, 3))
    live = job / f"events-{os.getpid()}.jsonl"
    live.write_text(_saved(1.5, 1, 1) + _saved(2.5, 1, 2) + _saved(3.5, 1, 3)[:20])  # a line being written
    log = _EventLog(tmp_path)
    assert log.saved("j", 0.0, INF) == {0: 3, 1: 2}
    assert log.saved("j", 2.0, 2.6) == {0: 2, 1: 2} and log.saved("j", 9.0, INF) == {}

    with live.open("a") as f:  # a live writer goes on; a restore rewinds it one step
        f.write(_saved(3.5, 1, 3)[20:] + _saved(3.6, 1, 2))
    assert log.saved("j", 0.0, INF) == {0: 3, 1: 3} and log.saved("j", 3.55, INF) == {1: 2}
    steps = [e["step"] for e in log.read("j")]
    assert steps == [1, 1, 2, 2, 3, 3, 2] and log.read(None) == log.read("j")

    with gone.open("a") as f:  # a writer this machine cannot see (another pid namespace) is read again now and then
        f.write(_saved(4.0, 0, 4))
    for _ in range(50):
        newest = log.saved("j", 0.0, INF)
    assert newest == {0: 4, 1: 3}
