"""Start real ffplane processes for tests and end them by PID, whatever happens."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

TOKEN = "test-token-0123456789"


@dataclass
class Proc:
    popen: subprocess.Popen[bytes]
    url: str
    ready: dict[str, object]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)
            self.popen.wait(timeout=15)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def start(module: str, args: list[str], workdir: Path, name: str, env: dict[str, str] | None = None, timeout_s: float = 30.0) -> Proc:
    """Run ``python -m module args... --ready-file F`` and wait until it is listening."""
    ready_file = workdir / f"{name}.ready"
    ready_file.unlink(missing_ok=True)
    log_path = workdir / f"{name}.log"
    full_env = {**os.environ, "FFPLANE_TOKEN": TOKEN, **(env or {})}
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(
            [sys.executable, "-m", module, *args, "--ready-file", str(ready_file)],
            stdout=log, stderr=subprocess.STDOUT, env=full_env,
        )
    deadline = time.monotonic() + timeout_s
    proc: Proc | None = None
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"{name} exited with {popen.returncode}:\n{log_path.read_text()}")
        if ready_file.exists():
            ready = json.loads(ready_file.read_text())
            proc = Proc(popen, f"http://{ready['host']}:{ready['port']}", ready, log_path)
            try:
                urllib.request.urlopen(proc.url + "/v1/health", timeout=2).read()
                return proc
            except OSError:
                pass
        time.sleep(0.05)
    popen.kill()
    popen.wait()
    raise RuntimeError(f"{name} did not become ready in {timeout_s}s:\n{log_path.read_text()}")
