"""Whether a process is still there, for the workers the daemon serves."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """False for a PID that is gone or a zombie (killed, not yet reaped by its launcher)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
