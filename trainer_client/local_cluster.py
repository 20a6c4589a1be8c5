"""Run ffplane's servers as real processes on this machine (quickstart, benchmarks, tests).

Each server is started with ``--port 0 --ready-file F`` and is ready when F names its port and
``/v1/health`` answers; ``stop()`` sends SIGTERM (graceful), ``kill()`` SIGKILL, both by PID.
"""

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

from dataserver.httpserver import DIE_WITH_PARENT_ENV



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


def start(module: str, args: list[str], workdir: Path, name: str, token: str, env: dict[str, str] | None = None, timeout_s: float = 30.0) -> Proc:
    """Run ``python -m module args... --ready-file F`` and wait until it is listening."""
    ready_file = workdir / f"{name}.ready"
    ready_file.unlink(missing_ok=True)
    log_path = workdir / f"{name}.log"
    full_env = {**os.environ, "FFPLANE_TOKEN": token, **(env or {})}
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(
            [sys.executable, "-m", module, *args, "--ready-file", str(ready_file)],
            stdout=log, stderr=subprocess.STDOUT, env={**full_env, DIE_WITH_PARENT_ENV: "1"},
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


class LocalCluster:
    """A data server and node daemons on this machine, for trying ffplane and for benchmarks.

    Every process is ended by PID and every shared-memory root removed by ``close()``.
    """

    def __init__(self, workdir: Path, data_dir: Path, token: str, shm_parent: Path = Path("/dev/shm")) -> None:
        self.workdir, self.data_dir, self.token = workdir, data_dir, token
        self.shm_parent = shm_parent
        self.dataserver: Proc | None = None
        self.daemons: list[Proc] = []
        self.roots: list[Path] = []

    def start_dataserver(self, *extra: str) -> Proc:
        self.dataserver = start("dataserver", ["serve", "--data-dir", str(self.data_dir), "--port", "0", *extra], self.workdir, "dataserver", self.token)
        return self.dataserver

    def start_daemon(self, *extra: str, budget_mb: int = 1024) -> Proc:
        assert self.dataserver is not None, "start the data server first"
        root = self.shm_parent / f"ffplane-local-{os.getpid()}-{len(self.daemons)}"
        self.roots.append(root)
        args = ["serve", "--dataserver", self.dataserver.url, "--root", str(root), "--port", "0", "--budget-mb", str(budget_mb), *extra]
        proc = start("statestore", args, self.workdir, f"daemon{len(self.daemons)}", self.token)
        self.daemons.append(proc)
        return proc

    def socket(self, i: int = 0) -> Path:
        return self.roots[i] / "daemon.sock"

    def close(self) -> None:
        import shutil

        for proc in [*self.daemons, *([self.dataserver] if self.dataserver else [])]:
            proc.stop()
        for root in self.roots:
            shutil.rmtree(root, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
