"""The recovery timeline as files: a handler on the library's ``ffplane.timeline`` logger
(``trainer_client.events``) that writes each event as one JSON line in
``<dir>/events-<pid>.jsonl`` — what the demo, the chaos soak and the recovery benchmarks read
back (``job_runner._EventLog``, the tests' own readers).

A line: ``t`` (wall-clock seconds, so several processes' lines merge), ``kind``, the event's
fields, and who wrote it (``pid``, ``rank`` from ``$RANK``, ``node`` from ``$FFPLANE_NODE``).
Before a process's first event comes ``process_start``: its start time, from /proc (fork/exec,
before the interpreter and torch load). The library's ``batch`` record carries the batch the
training loop got; it is written as ``batch`` with the step and an XXH3 of those bytes (the chaos
soak's exactly-once check), computed here, only when ``attach_timeline(..., batches=True)``.

A worker the harness launches attaches it itself, first thing (``ffplane_harness.worker``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from trainer_client.events import TIMELINE_LOGGER, TimelineEvent

__all__ = ["TimelineFiles", "attach_timeline", "batch_digest", "detach_timeline"]


class TimelineFiles(logging.Handler):
    """Writes the timeline's records to ``<directory>/events-<pid>.jsonl``, a line each (the
    file opened per line: a SIGKILLed worker leaves every line it wrote, whole)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        super().__init__()
        self.directory = os.fspath(directory)
        self._started: int | None = None  # the pid whose process_start is written (a fork writes its own)

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "timeline", None)
        if not isinstance(event, TimelineEvent):
            return
        try:
            self._write(record.created, event)
        except Exception:  # noqa: BLE001 - logging's contract: a handler reports, never raises
            self.handleError(record)

    def _write(self, now: float, event: TimelineEvent) -> None:
        fields = event.fields
        if event.kind == "batch":
            fields = {"step": fields["step"], "digest": batch_digest(fields["batch"])}
        pid = os.getpid()
        lines: list[dict[str, Any]] = []
        if self._started != pid:
            self._started = pid
            lines.append({"t": _process_start(), "kind": "process_start"})
        lines.append({"t": now, "kind": event.kind, **fields})
        who = {"pid": pid, "rank": int(os.environ.get("RANK", "-1")), "node": os.environ.get("FFPLANE_NODE", "")}
        with open(os.path.join(self.directory, f"events-{pid}.jsonl"), "a") as f:
            f.write("".join(json.dumps({**line, **who}) + "\n" for line in lines))


def attach_timeline(directory: str | os.PathLike[str], batches: bool = True) -> TimelineFiles:
    """Write this process's timeline events to ``directory`` (``batches``: with the per-step
    ``batch`` lines, a digest and a file append a step; a benchmark that times steps leaves
    them out). Returns the handler, for ``detach_timeline``."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    handler = TimelineFiles(directory)
    logger = logging.getLogger(TIMELINE_LOGGER)
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if batches else logging.INFO)
    return handler


def detach_timeline(handler: TimelineFiles) -> None:
    """Stop writing ``handler``'s events (the library builds none once no handler is left)."""
    logger = logging.getLogger(TIMELINE_LOGGER)
    logger.removeHandler(handler)
    if not logger.handlers:
        logger.setLevel(logging.NOTSET)
    handler.close()


def batch_digest(batch: Any) -> str:
    """XXH3 of a batch as the training loop got it: each column's name and bytes, in order
    (tensors as their raw bytes, wherever they live; binary columns value by value, each with
    its length). Two runs that trained on the same samples in the same order agree."""
    import torch
    import xxhash

    digest = xxhash.xxh3_64()
    for name, column in batch.items() if isinstance(batch, dict) else [("", batch)]:
        digest.update(str(name).encode() + b"\0")
        if isinstance(column, torch.Tensor):
            flat = column.detach().cpu().contiguous().reshape(-1)
            if flat.numel():
                digest.update(flat.view(torch.uint8).numpy().data)
        else:
            for value in column:
                view = memoryview(value)
                digest.update(view.nbytes.to_bytes(8, "little"))
                digest.update(view)
    return digest.hexdigest()


def _process_start() -> float:
    """This process's start, wall clock (fork/exec time, before the interpreter and torch load)."""
    try:
        ticks = int(Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()
