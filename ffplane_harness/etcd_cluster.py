"""An etcd cluster of real ``etcd`` processes (Debian's ``etcd-server``), for the demo, the
benchmarks and the tests: on loopback, or one member per given network-namespace node. Every
member is ended by PID and its data directory removed by ``close()``.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ffplane_runtime.etcd import Etcd, EtcdUnavailable


class EtcdMissing(RuntimeError):
    """No ``etcd`` binary: ``apt-get install -y etcd-server`` (Debian/Ubuntu) or put etcd on PATH."""


def available() -> str | None:
    """None if an etcd binary is on PATH, else what to install."""
    return None if shutil.which("etcd") else "etcd is not installed (apt-get install -y etcd-server)"


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (all held until each is known)."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@dataclass
class Member:
    name: str
    client_url: str
    popen: subprocess.Popen[bytes]
    data_dir: Path

    @property
    def endpoint(self) -> str:
        return self.client_url.split("://", 1)[1]

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=10)


class EtcdCluster:
    """``len(hosts)`` members, member ``i`` listening on ``hosts[i]`` and started through
    ``wraps[i]`` (e.g. ``Node.exec_argv`` of a namespace), or all on loopback."""

    def __init__(
        self,
        workdir: Path,
        hosts: list[str] | None = None,
        wraps: list[Callable[[list[str]], list[str]] | None] | None = None,
    ) -> None:
        if shutil.which("etcd") is None:
            raise EtcdMissing(str(available()))
        self.workdir = workdir
        self.hosts = hosts or ["127.0.0.1"] * 3
        self.wraps = wraps or [None] * len(self.hosts)
        self.members: list[Member] = []

    def start(self, timeout_s: float = 30.0) -> EtcdCluster:
        # ports are picked here for every member (loopback hosts share this namespace's ports)
        ports = _free_ports(2 * len(self.hosts))
        peers = [f"http://{h}:{ports[2 * i + 1]}" for i, h in enumerate(self.hosts)]
        initial = ",".join(f"e{i}={p}" for i, p in enumerate(peers))
        token = f"ffplane-{time.monotonic_ns()}"
        for i, host in enumerate(self.hosts):
            client = f"http://{host}:{ports[2 * i]}"
            data_dir = self.workdir / f"etcd-e{i}"
            argv = [
                "etcd",
                "--name", f"e{i}",
                "--data-dir", str(data_dir),
                "--listen-client-urls", client,
                "--advertise-client-urls", client,
                "--listen-peer-urls", peers[i],
                "--initial-advertise-peer-urls", peers[i],
                "--initial-cluster", initial,
                "--initial-cluster-token", token,
                "--initial-cluster-state", "new",
                # a lost member's peers elect a new leader in ~0.5 s instead of ~1 s
                "--heartbeat-interval", "50",
                "--election-timeout", "500",
            ]  # fmt: skip
            wrap = self.wraps[i]
            with open(self.workdir / f"etcd-e{i}.log", "ab") as log:
                popen = subprocess.Popen(wrap(argv) if wrap else argv, stdout=log, stderr=subprocess.STDOUT)
            self.members.append(Member(f"e{i}", client, popen, data_dir))
        deadline = time.monotonic() + timeout_s
        client_ = self.client(retry_s=timeout_s)
        while True:
            try:
                client_.put(b"/ffplane/health", b"ok")
                return self
            except EtcdUnavailable:
                if time.monotonic() > deadline or any(m.popen.poll() is not None for m in self.members):
                    self.close()
                    raise RuntimeError(f"etcd did not start; logs in {self.workdir}/etcd-e*.log") from None

    @property
    def endpoints(self) -> str:
        """Every member's client endpoint, as ``--rdzv-endpoint`` and ``--etcd`` take them."""
        return ",".join(m.endpoint for m in self.members)

    def client(self, retry_s: float = 10.0) -> Etcd:
        return Etcd(self.endpoints, retry_s=retry_s)

    def close(self) -> None:
        for m in self.members:
            m.kill()
            shutil.rmtree(m.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
