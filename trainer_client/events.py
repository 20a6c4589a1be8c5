"""Recovery timeline events, written only when ``$FFPLANE_EVENTS_DIR`` is set (the demo and the
recovery benchmark set it): one JSON line per event in ``<dir>/events-<pid>.jsonl``.

Kinds: ``process_start`` (the process's start time, from /proc, emitted with the first event),
``imported`` (the first of ``trainer_client``'s public names loaded: the interpreter and torch are), ``restoring``
(``Checkpointer.restore`` called: the process group, model and DDP are set up), ``restored`` (step, source), ``data_ready`` (the first batch after start-up is in hand, step),
``saved`` (every save, step), ``batch`` (every batch served: step and an XXH3 of its bytes). Wall-clock seconds, so several processes' lines can be merged.
``$FFPLANE_EVENTS_SKIP`` names kinds not written (comma-separated): a benchmark that reads only
``saved`` leaves out ``batch``, a digest and a file append per step that its baseline never pays.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

EVENTS_ENV = "FFPLANE_EVENTS_DIR"
SKIP_ENV = "FFPLANE_EVENTS_SKIP"
_lock = threading.Lock()
_started = False


def _process_start() -> float:
    """This process's start, wall clock (fork/exec time, before the interpreter and torch load)."""
    try:
        ticks = int(open(f"/proc/{os.getpid()}/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


def _skipped(kind: str) -> bool:
    return kind in os.environ.get(SKIP_ENV, "").split(",")


def events_on(kind: str | None = None) -> bool:
    """Whether events (of ``kind``) are written: worth working out what one would say."""
    return bool(os.environ.get(EVENTS_ENV)) and (kind is None or not _skipped(kind))


def emit(kind: str, **fields: Any) -> None:
    directory = os.environ.get(EVENTS_ENV)
    if not directory or _skipped(kind):
        return
    global _started
    now = time.time()
    lines = []
    with _lock:
        if not _started:
            _started = True
            lines.append({"t": _process_start(), "kind": "process_start"})
        lines.append({"t": now, "kind": kind, **fields})
        who = {"pid": os.getpid(), "rank": int(os.environ.get("RANK", "-1")), "node": os.environ.get("FFPLANE_NODE", "")}
        with open(os.path.join(directory, f"events-{os.getpid()}.jsonl"), "a") as f:
            for line in lines:
                f.write(json.dumps({**line, **who}) + "\n")
