"""Warm worker starts: a restarted worker forks from an interpreter that has already imported torch.

After a failure torchrun restarts every worker of every node at once, and each new process first
spends about 1.3 s of CPU importing torch — on a two-core node with four workers that is most of
the time between the failure and the restored state. Launch the script through this module:

    torchrun --nnodes ... --max-restarts 100 -m trainer_client.warm_start train.py --its --args

The first worker on a node runs ``train.py`` as usual and, beside it, starts a *zygote*: a process
in a session of its own that imports torch once and waits on a local socket. A later worker
process (a torchrun restart) connects to it, hands over its argv, environment, working directory
and standard streams (the file descriptors themselves, over the socket), and the zygote forks a
child that runs the script as ``python train.py ...`` would. The process torchrun started stays
as the worker's stand-in: it forwards signals to the child and exits with the child's status (a
child killed by signal N kills its stand-in with N), so torchrun's monitoring, restarts and
shutdown see what they would see without it. A child whose stand-in dies (SIGKILLed by torchrun,
or the node's process tree killed) is SIGKILLed by the zygote at once.

Nothing is pickled: the request is a JSON header plus the three descriptors (SCM_RIGHTS), the
answers JSON lines. The socket and the zygote's pid file live in ``$FFPLANE_WARM_DIR`` (default
``/dev/shm/ffplane-warm-<uid>``), named for the interpreter and the installed torch, so a new
Python or torch never forks from an old zygote. The zygote imports only torch (with
``torch._dynamo``, which DDP's constructor imports, and ``$FFPLANE_WARM_PRELOAD``, comma-separated
modules); the script and ffplane's modules (all but this one; the package's names load lazily) are
imported fresh in every child, so edited code is picked up. Variables torch reads while it is
imported take the zygote's values (those of the first worker that started it). It exits after
``$FFPLANE_WARM_IDLE_S`` (default 600) seconds without children or requests, or on SIGTERM.
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import importlib.util
import io
import json
import os
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ffplane_contract.warm import warm_dir, zygotes

PRELOAD_ENV = "FFPLANE_WARM_PRELOAD"
IDLE_ENV = "FFPLANE_WARM_IDLE_S"
_LEN = struct.Struct("!I")
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


class WarmStartError(RuntimeError):
    """The zygote could not run the worker; the message says why."""


def socket_path() -> Path:
    """This interpreter's and torch's zygote socket (found without importing torch).

    The interpreter is named by what it is, not how it was called: torchrun starts workers with
    ``venv/bin/python3``, a spare's ``--prestart`` is typed as ``venv/bin/python`` (a link to it),
    and keyed on the path as called the prestarted zygote was never found (a node loss took 14.2 s
    instead of 3.7 s). ``sys.prefix`` keeps two virtual environments over one interpreter apart."""
    spec = importlib.util.find_spec("torch")
    origin = spec.origin if spec and spec.origin else ""
    stamp = os.stat(origin).st_mtime_ns if origin else 0
    python = os.path.realpath(sys.executable)
    key = hashlib.sha1(f"{python}|{sys.prefix}|{sys.version}|{origin}|{stamp}".encode()).hexdigest()[:12]
    return warm_dir() / f"z-{key}.sock"  # short: a socket path has at most 107 bytes


def stop(directory: Path) -> None:
    """SIGKILL the zygotes of ``directory`` and their children (a node that is gone), and remove
    the folder."""
    import shutil

    for pid in zygotes(directory):
        kill_tree(pid)
    shutil.rmtree(directory, ignore_errors=True)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts each worker in a session of its own, so a
    process group is not enough to end them)."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier]
        found += kids
        frontier = kids
    return found


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """SIGKILL ``pid`` and everything it started — a node's processes all die at once (or send
    them ``sig``: SIGSTOP freezes a node whose link died without a reset)."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


# ---- the worker's stand-in ------------------------------------------------------------------
def main(argv: list[str]) -> int:
    """Run ``argv`` (``script.py args`` or ``-m module args``) in a child of the zygote, or here
    (starting a zygote for the next time) if there is none yet."""
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    path = socket_path()
    conn = _connect(path)
    if conn is None:
        _start_zygote(path)
        return _run(argv)
    with conn:
        return _stand_in(conn, argv)


def _connect(path: Path) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
    except OSError:
        s.close()
        return None
    return s


def _stand_in(conn: socket.socket, argv: list[str]) -> int:
    header = json.dumps(
        {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "unbuffered": bool(getattr(sys.stdout, "write_through", False))}
    ).encode()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    socket.send_fds(conn, [_LEN.pack(len(header)) + header], [0, 1, 2])
    answers = conn.makefile("rb")
    first = _answer(answers)
    if "error" in first:
        raise WarmStartError(str(first["error"]))
    child = int(first["pid"])
    for sig in _FORWARDED:
        signal.signal(sig, lambda n, _f: _forward(child, n))
    end = _answer(answers)
    if "signal" in end:  # die the way the child died, so torchrun reports the same failure
        n = int(end["signal"])
        if n not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(n, signal.SIG_DFL)
        os.kill(os.getpid(), n)
        time.sleep(1)
        return 128 + n
    if "exit" in end:
        return int(end["exit"])
    # the zygote went away first: its orphaned child runs on; wait for it, status unknown
    _wait_pid(child)
    print(f"ffplane warm start: lost the zygote while worker {child} ran; its exit status is unknown", file=sys.stderr)
    return 1


def _answer(answers: Any) -> dict[str, Any]:
    """The zygote's next answer; {} if it closed the connection. (A forwarded signal does not cut
    the read short: its handler returns, and Python retries the call.)"""
    line = answers.readline()
    return json.loads(line) if line else {}


def _forward(child: int, n: int) -> None:
    try:
        os.kill(child, n)
    except ProcessLookupError:
        pass


def _wait_pid(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)


def _start_zygote(path: Path) -> None:
    """Start the zygote in the background (its own session: it outlives this worker)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    log = open(path.with_suffix(".log"), "ab")
    try:
        subprocess.Popen(
            [sys.executable, "-m", "trainer_client.warm_start", "--serve", str(path)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            close_fds=True,
        )
    finally:
        log.close()


def _run(argv: list[str]) -> int:
    """Run the script in this process, as ``python argv...`` would."""
    try:
        if argv[0] == "-m":
            if len(argv) < 2:
                raise SystemExit("warm_start: -m needs a module name")
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    return 0


# ---- the zygote -------------------------------------------------------------------------------
class _Zygote:
    def __init__(self, path: Path, idle_s: float) -> None:
        self.path, self.idle_s = path, idle_s
        self.children: dict[int, socket.socket] = {}  # child pid → its stand-in's connection
        self.by_conn: dict[socket.socket, int] = {}
        self.last_busy = time.monotonic()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.wake_r, self.wake_w = os.pipe()

    def bind(self) -> bool:
        """Listen on the socket; False if another zygote already does."""
        try:
            self.listener.bind(str(self.path))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            other = _connect(self.path)
            if other is not None:
                other.close()
                return False
            self.path.unlink(missing_ok=True)  # left by a zygote that died
            self.listener.bind(str(self.path))
        self.listener.listen(64)
        self.path.with_suffix(".pid").write_text(str(os.getpid()))
        return True

    def serve(self) -> None:
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the wakeup fd
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            while self.children or time.monotonic() - self.last_busy < self.idle_s:
                if not self.path.exists():  # the node's folder was removed (``stop``): the node is gone
                    break
                conns: list[socket.socket] = list(self.by_conn)
                ready, _, _ = select.select([self.listener.fileno(), self.wake_r, *(c.fileno() for c in conns)], [], [], 1.0)
                for fd in ready:
                    if fd == self.listener.fileno():
                        self._accept()
                    elif fd == self.wake_r:
                        os.read(self.wake_r, 512)
                    else:
                        self._stand_in_gone(next(c for c in conns if c.fileno() == fd))
                self._reap()
        finally:
            for child in list(self.children):
                _forward(child, signal.SIGKILL)
            self.path.unlink(missing_ok=True)
            self.path.with_suffix(".pid").unlink(missing_ok=True)

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        self.last_busy = time.monotonic()
        try:
            conn.settimeout(10)
            request, fds = _receive(conn)
            conn.settimeout(None)
        except (OSError, ValueError) as exc:
            _log("bad request refused", "warning", error=str(exc))
            try:
                _send(conn, {"error": f"bad warm-start request: {exc}"})
            except OSError:
                pass  # that client is gone already
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            self._become_worker(request, fds, conn)  # never returns
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        self.by_conn[conn] = pid
        _log("worker forked", pid=pid, argv=request["argv"], rank=request["env"].get("RANK"))
        try:
            _send(conn, {"pid": pid})
        except OSError:
            self._stand_in_gone(conn)

    def _become_worker(self, request: dict[str, Any], fds: list[int], conn: socket.socket) -> None:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGCHLD, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            for s in (self.listener, conn, *self.by_conn):
                s.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
            for target, fd in enumerate(fds[:3]):
                os.dup2(fd, target)
            for fd in fds:
                if fd > 2:
                    os.close(fd)
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update({str(k): str(v) for k, v in request["env"].items()})
            if request.get("unbuffered"):  # torchrun runs workers as ``python -u``
                for stream in (sys.stdout, sys.stderr):
                    if isinstance(stream, io.TextIOWrapper):
                        stream.reconfigure(line_buffering=True, write_through=True)
            code = _run([str(a) for a in request["argv"]])
        except BaseException:  # noqa: BLE001 - the worker's own traceback, as python would print it
            traceback.print_exc()
            # as the interpreter does for an unhandled exception: exit hooks see a crash (a
            # worker's "bye" to its daemons is for clean ends only)
            sys.last_type, sys.last_value, sys.last_traceback = sys.exc_info()
        finally:
            try:
                atexit._run_exitfuncs()
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)

    def _stand_in_gone(self, conn: socket.socket) -> None:
        """The stand-in's connection closed or spoke: it died (a stand-in never writes twice)."""
        pid = self.by_conn.pop(conn)
        _forward(pid, signal.SIGKILL)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            self.by_conn.pop(conn, None)
            self.last_busy = time.monotonic()
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
            _log("worker exited", pid=pid, signal=sig or None, exit=None if sig else os.waitstatus_to_exitcode(status))
            try:
                _send(conn, {"signal": sig} if sig else {"exit": os.waitstatus_to_exitcode(status)})
            except OSError:
                pass  # the stand-in is gone too
            conn.close()


def _log(msg: str, level: str = "info", **fields: Any) -> None:
    """One structured line on the zygote's stderr (its log file, beside the socket)."""
    print(
        json.dumps(
            {
                "ts": round(time.time(), 3),
                "level": level,
                "logger": __name__.replace("__main__", "trainer_client.warm_start"),
                "msg": msg,
                **fields,
            }
        ),
        file=sys.stderr,
        flush=True,
    )


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    if len(data) < _LEN.size:
        raise ValueError("no header")
    (n,) = _LEN.unpack_from(data)
    body = data[_LEN.size :]
    while len(body) < n:
        more = conn.recv(n - len(body))
        if not more:
            raise ValueError("header cut short")
        body += more
    if len(fds) != 3:
        raise ValueError(f"expected 3 file descriptors, got {len(fds)}")
    request = json.loads(body)
    if not (
        isinstance(request, dict)
        and isinstance(request.get("argv"), list)
        and request["argv"]
        and isinstance(request.get("env"), dict)
        and isinstance(request.get("cwd"), str)
    ):
        raise ValueError("header needs argv (non-empty list), env (object) and cwd (string)")
    return request, fds


def _send(conn: socket.socket, msg: dict[str, Any]) -> None:
    conn.sendall(json.dumps(msg).encode() + b"\n")


def serve(path: Path, idle_s: float, preload: Sequence[str] = ()) -> int:
    """The zygote at ``path``: imports torch (and ``preload``), forks workers until ``idle_s`` idle."""
    z = _Zygote(path, idle_s)
    if not z.bind():
        return 0  # another worker's zygote won the race
    started = time.perf_counter()
    # torch._dynamo: DDP's constructor imports it (sympy and all), ~1 s of CPU more than torch
    modules = [
        "torch",
        "torch.distributed",
        "torch.nn.parallel",
        "torch.optim",
        "torch._dynamo",
        *preload,
    ]
    for name in modules:
        importlib.import_module(name.strip())
    import_s = round(time.perf_counter() - started, 3)
    marker = path.with_suffix(".ready")  # what ``readiness`` (the daemon's /v1/state, ffplane status) reads
    marker.write_text(json.dumps({"pid": os.getpid(), "import_s": import_s, "python": os.path.realpath(sys.executable)}))
    _log("zygote ready", socket=str(path), preloaded=modules, import_s=import_s, idle_exit_s=idle_s)
    try:
        z.serve()
    finally:
        marker.unlink(missing_ok=True)
    _log("zygote exits: idle", socket=str(path))
    return 0


def prestart(wait_s: float = 120.0) -> int:
    """Start this node's zygote now, before any worker runs here (a warm spare node), and (with
    ``wait_s`` > 0) wait until it has torch imported, saying so in one line."""
    path = socket_path()
    conn = _connect(path)
    if conn is not None:
        conn.close()
    else:
        _start_zygote(path)
    marker, deadline = path.with_suffix(".ready"), time.monotonic() + wait_s
    while wait_s > 0:
        try:
            info = json.loads(marker.read_text())
            print(f"ffplane warm start: zygote ready (pid {info['pid']}, torch imported in {info['import_s']} s) at {path}", flush=True)
            return 0
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if time.monotonic() > deadline:
            print(
                f"ffplane warm start: the zygote at {path} is not ready after {wait_s:.0f} s; see {path.with_suffix('.log')}",
                file=sys.stderr,
            )
            return 1
        time.sleep(0.1)
    print(f"ffplane warm start: zygote starting at {path} (log: {path.with_suffix('.log')})", flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--prestart"]:
        sys.exit(prestart(0.0 if "--no-wait" in sys.argv[2:] else 120.0))
    if sys.argv[1:2] == ["--serve"]:
        preload = [name for name in os.environ.get(PRELOAD_ENV, "").split(",") if name]
        sys.exit(serve(Path(sys.argv[2]), float(os.environ.get(IDLE_ENV, "600")), preload))
    sys.exit(main(sys.argv[1:]))
