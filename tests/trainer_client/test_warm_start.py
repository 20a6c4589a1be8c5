"""Warm starts: a worker launched through ``trainer_client.warm_start`` runs in a child of a zygote
that has torch imported, and looks to its launcher exactly like the process it replaced."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ffplane_harness.cli import render_status
from tests._servers import until
from trainer_client.warm_start import socket_path, stop

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, os, sys, time
print(json.dumps({"argv": sys.argv, "x": os.environ.get("X"), "cwd": os.getcwd(), "pid": os.getpid(),
                  "ppid": os.getppid(), "torch_preloaded": "torch" in sys.modules}), flush=True)
if sys.argv[1] == "sleep":
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def warm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    directory = Path(f"/dev/shm/ffw-test-{os.getpid()}")  # short: socket paths have at most 107 bytes
    (tmp_path / "job.py").write_text(SCRIPT)
    monkeypatch.setenv("FFPLANE_WARM_DIR", str(directory))  # for socket_path() in this process too
    env = {**os.environ, "PYTHONPATH": str(REPO), "FFPLANE_WARM_IDLE_S": "120"}
    try:
        yield env
    finally:
        stop(directory)  # the zygote and any child, by PID; the folder removed
    assert not directory.exists()


def _launch(tmp_path: Path, env: dict[str, str], *args: str, x: str = "") -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "trainer_client.warm_start", "job.py", *args],
        cwd=tmp_path,
        env={**env, "X": x},
        stdout=subprocess.PIPE,
        text=True,
    )


def _cold_start(tmp_path: Path, env: dict[str, str], code: str = "0", x: str = "") -> tuple[dict[str, object], int]:
    """The first launch: it runs the script itself and starts the zygote; (what the script saw,
    the launched process's pid). Returns once the zygote listens (a launch then waits for its preload)."""
    first = _launch(tmp_path, env, code, x=x)
    out, _ = first.communicate(timeout=120)
    assert first.returncode == int(code)
    pidfile = socket_path().with_suffix(".pid")
    until(lambda: pidfile.exists() and _listening(), timeout_s=120, what="the zygote listening")
    return json.loads(out), first.pid


def _zygote() -> int:
    return int(socket_path().with_suffix(".pid").read_text())


def _child(p: subprocess.Popen[str]) -> int:
    """The pid of the zygote's child that a warm launch runs in."""
    assert p.stdout is not None
    return int(json.loads(p.stdout.readline())["pid"])


def test_restarts_fork_from_the_zygote_with_their_own_argv_env_cwd_and_status(tmp_path: Path, warm: dict[str, str]) -> None:
    cold, pid = _cold_start(tmp_path, warm, "3", x="one")
    assert cold["pid"] == pid and not cold["torch_preloaded"]  # ran in the launched process itself

    second = _launch(tmp_path, warm, "4", x="two")
    out, _ = second.communicate(timeout=60)
    got = json.loads(out)
    assert second.returncode == 4
    assert got["ppid"] == _zygote() and got["pid"] != second.pid and got["torch_preloaded"]
    assert got["x"] == "two" and got["argv"] == ["job.py", "4"] and got["cwd"] == str(tmp_path)


def test_signals_pass_both_ways(tmp_path: Path, warm: dict[str, str]) -> None:
    _cold_start(tmp_path, warm)
    zygote = _zygote()

    # the worker SIGKILLed: its stand-in dies of SIGKILL too (what torchrun watches)
    p = _launch(tmp_path, warm, "sleep")
    os.kill(_child(p), signal.SIGKILL)
    assert p.wait(timeout=30) == -signal.SIGKILL

    # torchrun stopping a worker: SIGTERM reaches the child, which dies of it
    p = _launch(tmp_path, warm, "sleep")
    child = _child(p)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == -signal.SIGTERM
    until(lambda: not _alive(child), what="the child gone")

    # the stand-in SIGKILLed (no forwarding possible): the zygote ends the child
    p = _launch(tmp_path, warm, "sleep")
    child = _child(p)
    p.kill()
    p.wait(timeout=30)
    until(lambda: not _alive(child), what="the orphaned child ended by the zygote")
    assert _alive(zygote)


def test_a_malformed_request_gets_an_error_and_the_zygote_serves_on(tmp_path: Path, warm: dict[str, str]) -> None:
    _cold_start(tmp_path, warm)
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(socket_path()))
        body = b'{"argv": []}'
        socket.send_fds(s, [len(body).to_bytes(4, "big") + body], [0, 1, 2])
        reply = json.loads(s.makefile("rb").readline())
    assert "argv" in reply["error"]
    p = _launch(tmp_path, warm, "5")
    p.communicate(timeout=60)
    assert p.returncode == 5


def _listening() -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(socket_path()))
        except OSError:
            return False
    return True


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_zygote_prestarted_through_one_name_of_the_interpreter_serves_workers_started_through_another(
    tmp_path: Path, warm: dict[str, str], start_daemon: Any, dataserver: Any
) -> None:
    """The docs prestart a spare's zygote with ``venv/bin/python``; torchrun starts workers with
    ``venv/bin/python3`` (a link to it). The zygote was keyed on the name as called, so the spare
    stayed cold. Its readiness shows in the daemon's /v1/state (and ffplane status)."""
    bindir = Path(sys.executable).parent
    names = [bindir / n for n in ("python", "python3") if (bindir / n).exists()]
    if len(names) < 2 or names[0].resolve() != names[1].resolve():
        pytest.skip(f"needs python and python3 naming one interpreter in {bindir}")
    pre = subprocess.run(
        [str(names[0]), "-m", "trainer_client.warm_start", "--prestart"], env=warm, capture_output=True, text=True, timeout=180
    )
    assert pre.returncode == 0 and "zygote ready" in pre.stdout, pre.stdout + pre.stderr
    p = subprocess.Popen(
        [str(names[1]), "-m", "trainer_client.warm_start", "job.py", "0"], cwd=tmp_path, env=warm, stdout=subprocess.PIPE, text=True
    )
    out, _ = p.communicate(timeout=120)
    got = json.loads(out)
    assert p.returncode == 0 and got["torch_preloaded"] and got["ppid"] == _zygote()  # before: cold, in the process itself
    daemon = start_daemon()
    warm_state = httpx.get(f"{daemon.url}/v1/state").json()["warm"]
    assert warm_state["ready"] == 1 and warm_state["starting"] == 0
    until(lambda: httpx.get(dataserver.url + "/v1/nodes").json()["ring"], what="the daemon in the ring")
    table = render_status(httpx.get(dataserver.url + "/v1/cluster").json()).splitlines()
    assert table[1].split()[-1] == "WARM" and table[2].split()[-1] == "ready", table
