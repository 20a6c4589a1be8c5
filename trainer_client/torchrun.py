"""One ``torchrun`` per node, the way users launch jobs (c10d rendezvous, ``--max-restarts``),
for the demo, the recovery benchmark and the tests: start a node's agent, kill a node (the agent
and every worker it started), check the environment a restartable job needs.

torchrun 2.13 shares the rendezvous TCPStore with the workers across restarts by default, so a
restarted process group reads the previous generation's gloo addresses — "Connection refused"
or a hang in about half of the worker restarts — and a node that joins later waits for a
``MASTER_ADDR`` the old rank 0 never republishes. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
gives every round a fresh store (docs/decisions.md); :func:`check_restartable` warns when a
restartable job runs without it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

FRESH_STORE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def check_restartable() -> None:
    """Warn (once per process) when torchrun will restart this worker into a shared, stale store."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        warnings.warn(
            "torchrun runs this job with --max-restarts but shares its rendezvous store with the workers: "
            "restarted workers may read a dead peer's address (gloo 'Connection refused' or a hang). "
            "Launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment.",
            RuntimeWarning, stacklevel=2,
        )


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


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and everything it started — a node's processes all die at once."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


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
    max_restarts: int = 3
    # Restarted workers fork from a zygote that has torch imported (trainer_client.warm_start),
    # which keeps its socket here: one folder per node, so a replacement node starts cold.
    warm_dir: Path | None = None
    popen: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        # keep-alive 1 s x 2: a lost agent leaves the rendezvous in ~2 s instead of 15 s, so the
        # survivors' next round is not held up waiting for it.
        conf = f"is_host={int(self.host)},keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=120"
        return [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.nnodes), "--nproc-per-node", str(self.nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.run_id, "--rdzv-conf", conf,
            "--local-addr", "127.0.0.1", "--max-restarts", str(self.max_restarts), "--monitor-interval", "0.2",
            *(["-m", "trainer_client.warm_start"] if self.warm_dir else []), str(self.script), *self.args,
        ]

    def start(self) -> TorchrunNode:
        env = {**os.environ, **FRESH_STORE_ENV, "OMP_NUM_THREADS": "1", **self.env}
        if self.warm_dir:
            self.warm_dir.mkdir(parents=True, exist_ok=True)
            env["FFPLANE_WARM_DIR"] = str(self.warm_dir)
        with open(self.log, "ab") as log:
            self.popen = subprocess.Popen(self.argv(), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def kill(self) -> None:
        """The node is gone: the agent and its workers SIGKILLed together."""
        if self.popen is not None:
            kill_tree(self.popen.pid)
            self.popen.wait()
        if self.warm_dir is not None:  # the zygote too (its own session: not below the agent)
            from trainer_client.warm_start import stop

            stop(self.warm_dir)

    def wait(self, timeout_s: float) -> int:
        assert self.popen is not None, "start() first"
        return self.popen.wait(timeout=timeout_s)

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None
