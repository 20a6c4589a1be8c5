"""Run ffplane's servers as real processes on this machine (quickstart, benchmarks, tests).

Each server is started with ``--port 0 --ready-file F`` and is ready when F names its port and
``/v1/health`` answers; ``stop()`` sends SIGTERM (graceful), ``kill()`` SIGKILL, both by PID.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ffplane_contract.auth import TOKEN_ENV
from ffplane_contract.files import SOCKET_NAME
from ffplane_harness.netns import Netns
from ffplane_runtime.httpserver import DIE_WITH_PARENT_ENV


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


def start(
    module: str,
    args: list[str],
    workdir: Path,
    name: str,
    token: str,
    env: dict[str, str] | None = None,
    timeout_s: float = 30.0,
    wrap: Callable[[list[str]], list[str]] | None = None,
) -> Proc:
    """Run ``python -m module args... --ready-file F`` and wait until it is listening.

    ``wrap`` rewrites the command line, e.g. to run it inside a network namespace."""
    ready_file = workdir / f"{name}.ready"
    ready_file.unlink(missing_ok=True)
    log_path = workdir / f"{name}.log"
    full_env = {**os.environ, TOKEN_ENV: token, **(env or {})}
    with open(log_path, "ab") as log:
        argv = [sys.executable, "-m", module, *args, "--ready-file", str(ready_file)]
        popen = subprocess.Popen(
            wrap(argv) if wrap else argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**full_env, DIE_WITH_PARENT_ENV: "1"},
        )
    deadline = time.monotonic() + timeout_s
    proc: Proc | None = None
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"{name} exited with {popen.returncode}:\n{log_path.read_text()}")
        if ready_file.exists():
            ready = json.loads(ready_file.read_text())
            proc = Proc(
                popen, f"http://{ready.get('advertise') or ready['host']}:{ready['port']}", ready, log_path
            )  # a daemon on 0.0.0.0 is reached where it advertises
            try:
                urllib.request.urlopen(proc.url + "/v1/health", timeout=2).read()
                return proc
            except OSError:
                pass
        time.sleep(0.05)
    popen.kill()
    popen.wait()
    raise RuntimeError(f"{name} did not become ready in {timeout_s}s:\n{log_path.read_text()}")


_ROOT_PREFIX = "ffplane-local-"  # a daemon root: ffplane-local-<maker's pid>-<cluster>-<node>
_made = itertools.count()  # clusters made by this process: several may run at once (a paired benchmark)


def orphaned_roots(parent: Path = Path("/dev/shm")) -> list[Path]:
    """Daemon roots under ``parent`` whose maker has exited without removing them. A live maker's
    (a benchmark or test running beside this one) are not; its daemons die with it (``start``)."""
    return [p for p in parent.glob(f"{_ROOT_PREFIX}*") if not Path("/proc", p.name.removeprefix(_ROOT_PREFIX).split("-")[0]).exists()]


class LocalCluster:
    """A data server and node daemons on this machine, for trying ffplane, benchmarks and tests.

    Plain mode: every process on 127.0.0.1. With ``net`` (a :class:`ffplane_harness.netns.Netns`),
    the data server runs in node 0's namespace and daemon ``i`` in node ``i + 1``'s, each bound
    to its node's address, so links can be shaped and cut; with ``bind_all`` daemons listen on
    ``0.0.0.0`` and advertise their node's address, as the Kubernetes DaemonSet runs them. Every
    process is ended by PID and every shared-memory root removed by ``close()``.
    """

    def __init__(
        self,
        workdir: Path,
        data_dir: Path,
        token: str,
        shm_parent: Path = Path("/dev/shm"),
        net: Netns | None = None,
        bind_all: bool = False,
    ) -> None:
        self.workdir, self.data_dir, self.token = workdir, data_dir, token
        self.shm_parent = shm_parent
        self.net = net
        self.bind_all = bind_all
        self.dataservers: list[Proc] = []  # with --etcd there may be several; daemons are given them all
        self.daemons: list[Proc] = []
        self.roots: list[Path] = []
        self.serial = next(_made)  # this cluster's number among those this process made
        for root in orphaned_roots(shm_parent):  # a maker killed before its close() (SIGTERM, SIGKILL)
            shutil.rmtree(root, ignore_errors=True)

    def _place(self, node: int) -> tuple[str, Callable[[list[str]], list[str]] | None]:
        if self.net is None:
            return "127.0.0.1", None
        n = self.net.nodes[node]
        return n.addr, n.exec_argv

    @property
    def dataserver(self) -> Proc | None:
        """The first data server (the only one unless several were started)."""
        return self.dataservers[0] if self.dataservers else None

    @property
    def dataserver_urls(self) -> str:
        """Every data server's URL, comma-separated, as daemons take them (``--dataserver``)."""
        return ",".join(d.url for d in self.dataservers)

    def start_dataserver(self, *extra: str, port: int = 0, index: int = 0, node: int = 0) -> Proc:
        """Start data server ``index`` (or restart it, on the same ``port``) in namespace ``node``."""
        host, wrap = self._place(node)
        args = ["serve", "--data-dir", str(self.data_dir), "--host", host, "--port", str(port), *extra]
        proc = start("dataserver", args, self.workdir, f"dataserver{index or ''}", self.token, wrap=wrap)
        if index < len(self.dataservers):
            self.dataservers[index] = proc
        else:
            assert index == len(self.dataservers), "start data servers in index order"
            self.dataservers.append(proc)
        return proc

    def leader(self, timeout_s: float = 30.0) -> Proc:
        """The data server that coordinates now (with one, that one), waiting for one to."""
        deadline = time.monotonic() + timeout_s
        while True:
            for proc in self.dataservers:
                try:
                    if (
                        proc.popen.poll() is None
                        and json.loads(urllib.request.urlopen(f"{proc.url}/v1/leader", timeout=2).read())["leading"]
                    ):
                        return proc
                except (OSError, ValueError, KeyError):
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"no data server of {self.dataserver_urls} coordinates after {timeout_s:.0f} s")
            time.sleep(0.1)

    def root(self, node: int) -> Path:
        """Daemon ``node``'s shared-memory root: unique to this cluster, so one process may run several."""
        return self.shm_parent / f"{_ROOT_PREFIX}{os.getpid()}-{self.serial}-{node}"

    def start_daemon(self, *extra: str, budget_mb: int = 1024, index: int | None = None) -> Proc:
        """Start daemon ``index`` (default: the next one); restarting an index reuses its root."""
        assert self.dataserver is not None, "start the data server first"
        i = len(self.daemons) if index is None else index
        root = self.root(i)
        if root not in self.roots:
            self.roots.append(root)
        host, wrap = self._place(i + 1 if self.net else 0)
        listen = ["--host", "0.0.0.0", "--advertise-address", host] if self.bind_all else ["--host", host]
        args = [
            "serve",
            "--dataserver",
            self.dataserver_urls,
            "--root",
            str(root),
            *listen,
            "--port",
            "0",
            "--budget-mb",
            str(budget_mb),
            "--node-id",
            f"n{i}",
            *extra,
        ]
        proc = start("statestore", args, self.workdir, f"daemon{i}-{len(self.daemons)}", self.token, wrap=wrap)
        self.daemons.append(proc)
        return proc

    def lose_node(self, i: int) -> None:
        """Node ``i`` is gone: its daemon SIGKILLed and its shared memory wiped (workers are the
        caller's to kill). ``start_daemon(index=i)`` then brings up a replacement, empty."""
        import shutil

        for proc in self.daemons:
            if proc.ready.get("node_id") == f"n{i}" or proc.ready.get("root") == str(self.roots[i]):
                proc.kill()
        shutil.rmtree(self.roots[i], ignore_errors=True)

    def socket(self, i: int = 0) -> Path:
        return self.roots[i] / SOCKET_NAME

    def until_successor(self, i: int, successor: str, timeout_s: float = 30.0) -> None:
        """Wait until daemon ``i`` knows ``successor`` as its ring successor: commits before that
        are answered without a replica (a benchmark measuring replication must not start earlier)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with urllib.request.urlopen(self.daemons[i].url + "/v1/state", timeout=5) as resp:
                if json.loads(resp.read())["coordinator"].get("successor") == successor:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"daemon {i} did not learn its ring successor {successor} within {timeout_s:.0f} s")
            time.sleep(0.1)

    def worker_argv(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` placed on daemon ``i``'s node."""
        wrap = self._place(i + 1 if self.net else 0)[1]
        return wrap(argv) if wrap else argv

    def close(self) -> None:
        for proc in [*self.daemons, *self.dataservers]:
            proc.stop()
        for root in self.roots:
            shutil.rmtree(root, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
