"""A ``statestore serve`` setting, declared once in ``DaemonConfig``, reaches a real daemon from each
of its sources: ``--fetch-read-timeout-s`` as a flag, as ``$FFPLANE_STATESTORE_FETCH_READ_TIMEOUT_S``
and as ``fetch-read-timeout-s`` in the ``[statestore.serve]`` table of ``--config``."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from tests._servers import TOKEN, Proc, start
from tests.conftest import create_job
from trainer_client import DataLoader

TIMEOUT_S = 0.5  # the daemon's default is 10 s: a silent server would hold a step that long


class _Silent:
    """A data server that takes connections and reads requests but never answers; for each request
    (a batch fetch, or the job view the daemon checks generations against), how long its
    connection stayed open after the request arrived (until the daemon hung up)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[float] = []
        threading.Thread(target=self._accept, name="silent data server", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._hold, args=(conn,), name="silent connection", daemon=True).start()

    def _hold(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(60)
            with suppress(OSError):
                request = conn.recv(65536)
                arrived = time.monotonic()
                while conn.recv(65536):
                    pass
                if request.startswith(b"GET /v1/jobs/"):
                    self.held.append(time.monotonic() - arrived)


@contextmanager
def _daemon(source: str, dataserver: Proc, silent: _Silent, root: Path, work: Path) -> Iterator[Proc]:
    # one step per request, so the steps of the job take turns over the two servers
    args = ["serve", "--dataserver", f"{dataserver.url},{silent.url}", "--root", str(root), "--port", "0", "--budget-mb", "64"]
    args += ["--fetch-steps", "1"]
    env: dict[str, str] = {}
    if source == "flag":
        args += ["--fetch-read-timeout-s", str(TIMEOUT_S)]
    elif source == "env":
        env["FFPLANE_STATESTORE_FETCH_READ_TIMEOUT_S"] = str(TIMEOUT_S)
    else:
        (work / "ffplane.toml").write_text(f"[statestore.serve]\nfetch-read-timeout-s = {TIMEOUT_S}\n")
        args = ["--config", str(work / "ffplane.toml"), *args]
    daemon = start("statestore", args, work, f"daemon-{source}", env)
    try:
        yield daemon
    finally:
        daemon.stop()


@pytest.mark.parametrize("source", ["flag", "env", "file"])
def test_the_fetch_read_timeout_reaches_the_daemon_from_each_source(source: str, tmp_path: Path, dataserver: Proc, shm_root: Path) -> None:
    create_job(dataserver, dp=1, batch_per_rank=8, max_steps=8)
    silent = _Silent()
    try:
        with _daemon(source, dataserver, silent, shm_root, tmp_path) as daemon:
            loader = DataLoader("j1", 0, dataserver=dataserver.url, token=TOKEN, socket_path=shm_root / "daemon.sock")
            steps = sum(1 for _ in loader)
            log = daemon.log()
    finally:
        silent.sock.close()
    assert steps == 8  # each step the silent server held was fetched from the other
    assert silent.held, f"no request went to the silent server:\n{log[-3000:]}"
    # hung up after the timeout set (with slack for a loaded machine), well before the default 10 s
    assert all(TIMEOUT_S * 0.8 <= held < 5.0 for held in silent.held), silent.held
    assert "data server failing" in log and silent.url in log
