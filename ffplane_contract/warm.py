"""The warm-start zygotes' folder, as ``trainer_client.warm_start`` lays it out and the node daemon
reads it (a spare's readiness in ``/v1/state`` and ``ffplane status``): per zygote a socket
``z-<key>.sock``, a ``.pid`` file, a ``.log`` and, once torch is imported, a ``.ready`` marker
(JSON: pid, import_s, python)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

DIR_ENV = "FFPLANE_WARM_DIR"


def default_dir() -> Path:
    """Where zygotes live unless ``$FFPLANE_WARM_DIR`` (or the daemon's ``--warm-dir``) says."""
    return Path(f"/dev/shm/ffplane-warm-{os.getuid()}")


def warm_dir() -> Path:
    return Path(os.environ.get(DIR_ENV) or default_dir())


def zygotes(directory: Path) -> list[int]:
    """The running zygotes of ``directory``."""
    return [pid for pid, _ in _live(directory)]


def readiness(directory: Path) -> dict[str, Any]:
    """The zygotes of ``directory``: how many have torch imported (``ready``) and how many are
    still importing it (``starting``), which is what a warm spare's readiness is."""
    ready = 0
    live = _live(directory)
    for pid, pidfile in live:
        try:
            ready += json.loads(pidfile.with_suffix(".ready").read_text())["pid"] == pid
        except (OSError, ValueError, KeyError, TypeError):
            continue  # still importing (or a marker left by a dead zygote with this name)
    return {"dir": str(directory), "ready": ready, "starting": len(live) - ready}


def _live(directory: Path) -> list[tuple[int, Path]]:
    """(pid, pid file) of each running zygote of ``directory``."""
    found = []
    for pidfile in directory.glob("*.pid"):
        try:
            pid = int(pidfile.read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue  # gone already
        if b"trainer_client.warm_start" in cmdline and str(pidfile.with_suffix(".sock")).encode() in cmdline:
            found.append((pid, pidfile))
    return found
