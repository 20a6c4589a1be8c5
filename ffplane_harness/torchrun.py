"""One ``torchrun`` per node, the way users launch jobs (c10d rendezvous, ``--max-restarts``),
for the demo, the recovery benchmark and the tests: start a node's agent, kill a node (the agent
and every worker it started). The environment a restartable job needs is ``trainer_client.launch``'s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from trainer_client.launch import FRESH_STORE_ENV
from trainer_client.warm_start import kill_tree, stop, zygotes


@dataclass
class TorchrunNode:
    """``torchrun`` for one node: ``nproc`` workers of ``script``, in a rendezvous of ``nnodes``
    agents at ``endpoint``; ``host=True`` for the agent that hosts the rendezvous store."""

    script: Path
    args: list[str]
    endpoint: str
    run_id: str
    nnodes: int
    nproc: int
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    host: bool = False
    # "c10d": torch's, its store on the ``host`` agent; "ffplane": trainer_client.rendezvous, the
    # endpoint naming the etcd members
    rdzv: str = "c10d"
    local_addr: str = "127.0.0.1"  # the agent's address as its peers reach it
    # rewrites the command line, e.g. ``Node.exec_argv`` to run the node in its network namespace
    wrap: Callable[[list[str]], list[str]] | None = None
    max_restarts: int = 3
    # Restarted workers fork from a zygote that has torch imported (trainer_client.warm_start),
    # which keeps its socket here: one folder per node, so a replacement node starts cold.
    warm_dir: Path | None = None
    # launcher arguments between torchrun (or warm_start) and the script: a module the script
    # runs under, e.g. ``ffplane_harness.worker.entry(events)`` (the timeline's handler)
    entry: list[str] = field(default_factory=list)
    popen: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        # keep-alive 1 s x 2: a lost agent leaves the rendezvous in ~2 s instead of 15 s, so the
        # survivors' next round is not held up waiting for it.
        if self.rdzv == "ffplane":  # the README's line: dead nodes come from the coordinator
            conf = "keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=120"
        else:
            conf = f"is_host={int(self.host)},keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=120"
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(self.nnodes),
            "--nproc-per-node",
            str(self.nproc),
            "--rdzv-backend",
            self.rdzv,
            "--rdzv-endpoint",
            self.endpoint,
            "--rdzv-id",
            self.run_id,
            "--rdzv-conf",
            conf,
            "--local-addr",
            self.local_addr,
            "--max-restarts",
            str(self.max_restarts),
            "--monitor-interval",
            "0.2",
            *(["-m", "trainer_client.warm_start"] if self.warm_dir else []),
            *self.entry,
            str(self.script),
            *self.args,
        ]

    def start(self) -> TorchrunNode:
        env = {**os.environ, **FRESH_STORE_ENV, "OMP_NUM_THREADS": "1", **self.env}
        if self.warm_dir:
            self.warm_dir.mkdir(parents=True, exist_ok=True)
            env["FFPLANE_WARM_DIR"] = str(self.warm_dir)
        with open(self.log, "ab") as log:
            argv = self.wrap(self.argv()) if self.wrap else self.argv()
            self.popen = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def prestart(self) -> None:
        """Warm spare: start the node's zygote (torch imported) before its agent joins a round."""
        assert self.warm_dir is not None, "a warm spare needs warm_dir"
        self.warm_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", **self.env, "FFPLANE_WARM_DIR": str(self.warm_dir)}
        argv = [sys.executable, "-m", "trainer_client.warm_start", "--prestart"]
        subprocess.run(self.wrap(argv) if self.wrap else argv, env=env, check=True)

    def freeze(self, sig: int = signal.SIGSTOP) -> None:
        """The node's link died without a reset: the agent, its workers and the zygote stopped
        (SIGSTOP), so peers see silence, not closed connections (after a restart the workers are
        the zygote's children, not the agent's). ``kill()`` ends them, ``thaw()`` resumes them."""
        for pid in [*([self.popen.pid] if self.popen else []), *(zygotes(self.warm_dir) if self.warm_dir else [])]:
            kill_tree(pid, sig)

    def thaw(self) -> None:
        self.freeze(signal.SIGCONT)

    def kill(self) -> None:
        """The node is gone: the agent and its workers SIGKILLed together."""
        if self.popen is not None:
            kill_tree(self.popen.pid)
            self.popen.wait()
        if self.warm_dir is not None:  # the zygote too (its own session: not below the agent)
            stop(self.warm_dir)

    def wait(self, timeout_s: float) -> int:
        assert self.popen is not None, "start() first"
        return self.popen.wait(timeout=timeout_s)

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None
