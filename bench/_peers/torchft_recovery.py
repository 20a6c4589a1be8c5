"""torchft 0.2.0's live-peer recovery on the ``gpt_ddp`` state: the figure a checkpoint-restore tier is up against.

    python -m bench._peers.torchft_recovery          # measure(2, a temporary folder); prints the dict

Two replica groups of one rank each (``REPLICA_GROUP_ID`` 0 and 1, as two ``torchrun
--nproc-per-node 1`` would start them) train the example GPT (examples/train_ffplane.py, AdamW lr
3e-3, batch 32 x 65 tokens of vocab 512, one thread) under ``torchft.Manager`` +
``torchft.DistributedDataParallel`` + ``torchft.Optimizer`` over ``ProcessGroupGloo``, with a
``torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 1000``. Each group's
TCPStore lives in this process (as torchrun's agent holds it), so it outlives the worker. Per
round one group's worker is SIGKILLed by PID and started again as a fresh process; the restarted
worker heals from the live peer over HTTP. Every worker appends one JSON line per step (its
committed step, step time and the XXH3 of its model+optimizer bytes) to a log this process reads.

The same loop under plain torch DDP over gloo (no torchft) gives the step time and CPU it is read
against. Everything started here (lighthouse, workers) is SIGKILLed by PID on the way out.

One deviation from stock torchft: ``torchft.DistributedDataParallel``'s comm hook in 0.2.0 asserts
when the allreduce it waits on fails (``assert fut._fut`` in torchft/ddp.py), so a peer SIGKILLed
mid-allreduce takes the survivor down with it; the workers use a subclass whose hook hands the
bucket back instead (the Manager has recorded the error, so that step does not commit).
``measure(..., stock_hook=True)`` runs torchft's own hook and shows the survivor dying.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MODULE = "bench._peers.torchft_recovery"
WARM_STEPS = 5  # steps both groups commit before anything is timed
STEADY_STEPS = 20  # steps the step time and CPU are read over
TIMEOUT_S = 120.0  # the longest any wait here lasts before the run counts as failed


class _Failed(Exception):
    """The run cannot go on; the message says why (becomes ``unavailable``)."""


# ---------------------------------------------------------------- worker side (one rank process)


def _emit(log: Any, **event: Any) -> None:
    log.write(json.dumps(event) + "\n")
    log.flush()


def _model(rid: int) -> tuple[Any, Any, Any]:
    """The ``gpt_ddp`` state's model, AdamW and the group's batch, built alike in every process."""
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from train_ffplane import GPT

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, 512, (32, 65), generator=torch.Generator().manual_seed(1 + rid))
    return model, opt, data


def _loss(ddp: Any, data: Any, step: int) -> Any:
    import torch

    x = data.roll(step, 0)
    return torch.nn.functional.cross_entropy(ddp(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())


def _ft_classes(log: Any, stock_hook: bool) -> tuple[type, type]:
    """torchft's HTTP transport with the receive timed, and its DDP wrapper with a comm hook that
    survives a failed allreduce (``stock_hook``: torchft 0.2.0's own, which does not)."""
    import torch
    from torchft import DistributedDataParallel
    from torchft.checkpointing.http_transport import HTTPTransport

    class TimedHTTP(HTTPTransport):
        """The Manager's default transport (checkpoint_transport slot), logging when a receive ran."""

        def recv_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
            t0 = time.monotonic()
            out = super().recv_checkpoint(*args, **kwargs)
            _emit(log, ev="recv", t0=t0, t1=time.monotonic())
            return out

    class DDP(DistributedDataParallel):
        """torchft 0.2.0's hook asserts on the future a failed ``_ManagedWork.wait()`` never set (the
        peer died mid-allreduce) and on a ``_DummyWork``'s plain future (the manager already errored),
        killing the live peer too. Here the bucket comes back as it is: the Manager holds the error,
        so ``should_commit`` says no and this step's gradients are never applied."""

        @staticmethod
        def _comm_hook(manager, bucket):  # unannotated: DDP checks annotations against real types
            work = manager.allreduce(bucket.buffer())
            ok = work.wait()
            inner = getattr(work.get_future(), "_fut", None)
            if ok and inner is not None:
                return inner
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

    return TimedHTTP, DistributedDataParallel if stock_hook else DDP


def _ft_worker(log: Any, rid: int, stock_hook: bool) -> None:
    """One replica group's only rank under torchft; trains until killed."""
    from datetime import timedelta

    from torchft import Manager, Optimizer
    from torchft.process_group import ProcessGroupGloo

    from bench._peers.states import digest, leaves

    TimedHTTP, DistributedDataParallel = _ft_classes(log, stock_hook)
    model, opt, data = _model(rid)
    _emit(log, ev="imported", t=time.monotonic())
    t_mgr = time.monotonic()
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        min_replica_size=1,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), opt.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
        replica_id=f"gpt_ddp_{rid}",
        timeout=timedelta(seconds=10),
        checkpoint_transport=TimedHTTP(timeout=timedelta(seconds=10), num_chunks=0),
    )
    _emit(log, ev="manager", t0=t_mgr, t1=time.monotonic())
    ddp = DistributedDataParallel(manager, model)
    optim = Optimizer(manager, opt)
    while True:
        t0 = time.monotonic()
        optim.zero_grad()  # starts the quorum (async), as torchft's examples do
        before = manager.current_step()
        _loss(ddp, data, before).backward()
        optim.step()  # should_commit: heals here, steps the optimizer only if the step commits
        t1 = time.monotonic()
        step = manager.current_step()
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        nbytes = sum(t.nbytes for t in leaves(state))
        _emit(log, ev="step", step=step, commit=step > before, t=t1, dt=t1 - t0, digest=digest(state), nbytes=nbytes)


def _ddp_worker(log: Any, rid: int) -> None:
    """The same loop under torch DDP over gloo, two ranks, no torchft; trains until killed."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bench._peers.states import digest

    model, opt, data = _model(rid)
    dist.init_process_group("gloo", rank=rid, world_size=2)
    ddp = DDP(model)
    step = 0
    while True:
        t0 = time.monotonic()
        opt.zero_grad()
        _loss(ddp, data, step).backward()
        opt.step()
        t1 = time.monotonic()
        step += 1
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        _emit(log, ev="step", step=step, commit=True, t=t1, dt=t1 - t0, digest=digest(state))


def _worker(argv: list[str]) -> None:
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no worker outlives the orchestrator
    mode, rid, log_path = argv[0], int(argv[1]), argv[2]
    with open(log_path, "a") as log:
        _emit(log, ev="start", t=time.monotonic(), pid=os.getpid())
        if mode == "ft":
            _ft_worker(log, rid, argv[3] == "stock")
        else:
            _ddp_worker(log, rid)


# ---------------------------------------------------------------- orchestrator side


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class _Proc:
    """A process this run started (killed by PID on the way out) and, for a worker, its log's events."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], work: Path) -> None:
        self.name, self.log, self.out = name, work / f"{name}.jsonl", work / f"{name}.out"
        self.events: list[dict[str, Any]] = []
        self._off = 0
        with open(self.out, "w") as out:
            self.proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        self.pid = self.proc.pid

    def poll(self) -> None:
        try:
            with open(self.log, "rb") as f:
                f.seek(self._off)
                chunk = f.read()
        except FileNotFoundError:
            return
        done = chunk[: chunk.rfind(b"\n") + 1]
        self._off += len(done)
        self.events += [json.loads(line) for line in done.splitlines()]

    def ev(self, kind: str) -> dict[str, Any] | None:
        return next((e for e in self.events if e["ev"] == kind), None)

    def commits(self) -> dict[int, dict[str, Any]]:
        """Committed step number → its event."""
        return {e["step"]: e for e in self.events if e["ev"] == "step" and e["commit"]}

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait()

    def why(self) -> str:
        return f"{self.name} (pid {self.pid}, rc {self.proc.poll()}): {_tail(self.out)!r}"


def _wait(cond: Any, what: str, procs: list[_Proc], timeout: float = TIMEOUT_S) -> Any:
    """Poll every worker's log until ``cond()`` is true; a worker that exits or a timeout fails the run."""
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            p.poll()
        got = cond()
        if got:
            return got
        dead = [p for p in procs if p.proc.poll() is not None]
        if dead or time.monotonic() > deadline:
            why = "; ".join(p.why() for p in dead or procs)
            raise _Failed(f"{'a process exited' if dead else f'no progress in {timeout:.0f} s'} waiting for {what}: {why}")
        time.sleep(0.005)


def _env(**extra: Any) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _steady(workers: list[_Proc], n: int, helpers: list[_Proc] | None = None) -> dict[str, Any]:
    """Step time and CPU over the next ``n`` steps every worker commits, from a step all have reached;
    ``helpers`` (the lighthouse): their CPU per step of the whole job."""
    from bench._common import cpu_s

    helpers = helpers or []
    start = _wait(lambda: min(max(w.commits(), default=0) for w in workers), "a first committed step", workers)
    cpu0 = [cpu_s(w.pid) for w in workers]
    side0 = sum(cpu_s(h.pid) for h in helpers)
    _wait(lambda: all(start + n in w.commits() for w in workers), f"{n} steps", workers)
    cpu1 = [cpu_s(w.pid) for w in workers]
    side1 = sum(cpu_s(h.pid) for h in helpers)
    window = range(start + 1, start + n + 1)
    dts = [w.commits()[s]["dt"] for w in workers for s in window]
    same = all(len({w.commits()[s]["digest"] for w in workers}) == 1 for s in window)
    return {
        "dts": dts,
        "cpu_per_step_s": sum(b - a for a, b in zip(cpu0, cpu1)) / (n * len(workers)),
        "helpers_cpu_per_step_s": (side1 - side0) / n,
        "replicas_equal": same,
    }


def _plain_ddp(work: Path, procs: list[_Proc], tag: str) -> dict[str, Any]:
    """The same loop under torch DDP over gloo (2 ranks): the step time and CPU torchft adds to."""
    env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=_free_port())
    workers = [
        _Proc(f"ddp{r}_{tag}", [sys.executable, "-m", MODULE, "ddp", str(r), str(work / f"ddp{r}_{tag}.jsonl")], env, work) for r in (0, 1)
    ]
    procs += workers
    _wait(lambda: all(WARM_STEPS in w.commits() for w in workers), "plain DDP warm-up", workers)
    out = _steady(workers, STEADY_STEPS)
    for w in workers:
        w.kill()
    return out


class _FtJob:
    """The lighthouse, one TCPStore per replica group (held here, as torchrun's agent holds it) and the workers."""

    def __init__(self, work: Path, procs: list[_Proc], stock_hook: bool) -> None:
        from torch.distributed import TCPStore

        self.work, self.procs, self.spawned, self.hook = work, procs, 0, "stock" if stock_hook else "safe"
        port = _free_port()
        # exec'd from a launcher that first asks for SIGKILL should this process die (the PID stays)
        launch = "import ctypes, os, sys; ctypes.CDLL(None).prctl(1, 9); os.execvp(sys.argv[1], sys.argv[1:])"
        lighthouse = shutil.which("torchft_lighthouse")
        if lighthouse is None:
            raise _Failed("torchft_lighthouse is not on PATH (pip install torchft==0.2.0)")
        argv = [lighthouse, "--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "1000", "--bind", f"[::]:{port}"]
        self.lighthouse = _Proc("lighthouse", [sys.executable, "-c", launch, *argv], _env(), work)
        procs.append(self.lighthouse)
        self.addr = f"http://localhost:{port}"
        self.stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in (0, 1)]
        self.workers = [self.start(0), self.start(1)]

    def start(self, rid: int) -> _Proc:
        """A fresh worker process for replica group ``rid`` (what torchrun starts after a failure)."""
        name = f"ft{rid}_{self.spawned}"
        self.spawned += 1
        env = _env(
            REPLICA_GROUP_ID=rid,
            TORCHFT_LIGHTHOUSE=self.addr,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=self.stores[rid].port,
            RANK=0,
            LOCAL_RANK=0,
            WORLD_SIZE=1,
        )
        p = _Proc(name, [sys.executable, "-m", MODULE, "ft", str(rid), str(self.work / f"{name}.jsonl"), self.hook], env, self.work)
        self.procs.append(p)
        return p

    def watched(self) -> list[_Proc]:
        return [*self.workers, self.lighthouse]


def _round(job: _FtJob, victim: int) -> dict[str, Any]:
    """SIGKILL group ``victim``'s worker, start it again, time its heal and check its state against the peer's."""
    survivor = job.workers[1 - victim]
    s_kill = max(survivor.commits())
    t_kill = time.monotonic()
    job.workers[victim].kill()
    new = job.workers[victim] = job.start(victim)
    first = _wait(lambda: min(new.commits(), default=None), "the restarted worker's first committed step", job.watched())
    check = range(first, first + 3)  # the heal step and the two after it, on both
    _wait(lambda: all(s in w.commits() for w in job.workers for s in check), "steps after the heal", job.watched())
    mine, peer = new.commits(), survivor.commits()
    t_first = mine[first]["t"]
    tried = [e for e in survivor.events if e["ev"] == "step" and t_kill < e["t"] <= t_first]  # the survivor's attempts meanwhile
    after = [s for s in peer if peer[s]["t"] > t_kill]
    start, manager, recv = new.ev("start"), new.ev("manager"), new.ev("recv")
    return {
        "kill_to_first_step_s": t_first - t_kill,
        "kill_to_process_start_s": start["t"] - t_kill,
        "imports_s": new.ev("imported")["t"] - start["t"],
        "imported_to_first_step_s": t_first - new.ev("imported")["t"],  # torchft's part: Manager, quorum, heal, step
        "heal_s": recv["t1"] - manager["t0"] if recv else None,
        "recv_s": recv["t1"] - recv["t0"] if recv else None,
        "manager_init_s": manager["t1"] - manager["t0"],
        "steps_lost": max(0, s_kill + 1 - min(after)),  # committed steps the job rolled back
        "survivor_stall_s": peer[min(after)]["t"] - t_kill,  # kill → the survivor's next committed step
        "survivor_aborted_steps": sum(not e["commit"] for e in tried),  # attempts that did not commit
        "survivor_steps_alone": sum(e["commit"] and e["step"] < first for e in tried),  # on half the global batch
        "verified": all(mine[s]["digest"] == peer[s]["digest"] for s in check),
        "heal_step": first,
        "killed_at_step": s_kill,
    }


def _summaries(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    from bench._common import summary

    out: dict[str, Any] = {}
    for key in rounds[0]:
        values = [r[key] for r in rounds]
        if key == "verified":
            out[key] = all(values)
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = summary(values)
        else:
            out[key] = values
    return out


def _overhead(plain: list[dict[str, Any]], ft: list[dict[str, Any]], lighthouse_cpu: float) -> dict[str, Any]:
    """Step time and CPU per step of torchft's loop against plain DDP's, each pooled over its windows
    (run plain, torchft, kills, torchft, plain: a drift in the machine's load falls on both)."""
    from bench._common import summary

    def pooled(windows: list[dict[str, Any]]) -> dict[str, Any]:
        return summary([dt for w in windows for dt in w["dts"]])

    step = {"torchft": pooled(ft), "plain_ddp_gloo": pooled(plain)}
    step["ratio_of_medians"] = step["torchft"]["median"] / step["plain_ddp_gloo"]["median"]
    cpu = {name: sum(w["cpu_per_step_s"] for w in ws) / len(ws) for name, ws in (("torchft", ft), ("plain_ddp_gloo", plain))}
    return {
        "step_s": step,
        "cpu_per_step_s": {**cpu, "lighthouse": lighthouse_cpu},
        "replicas_equal_in_steady_state": all(w["replicas_equal"] for w in plain + ft),
    }


def measure(rounds: int, work: Path, stock_hook: bool = False) -> dict[str, Any]:
    """torchft's live-peer recovery, ``rounds`` kills; min/median/max of each figure, or ``unavailable``.
    ``stock_hook``: torchft 0.2.0's own DDP comm hook (the survivor dies with the killed peer)."""
    try:
        from importlib.metadata import version

        import torchft  # noqa: F401

        torchft_version = version("torchft")
    except Exception as exc:  # noqa: BLE001 - any import failure means the peer is not installed here
        return {"unavailable": f"import torchft failed: {exc!r}"}
    tmp = Path(tempfile.mkdtemp(prefix="torchft_recovery_", dir=work))
    procs: list[_Proc] = []
    job = None
    try:
        plain = [_plain_ddp(tmp, procs, "before")]
        job = _FtJob(tmp, procs, stock_hook)
        # a group that joins late heals and starts at the other's step: count its commits, not step numbers
        _wait(lambda: all(len(w.commits()) >= WARM_STEPS for w in job.workers), "torchft warm-up", job.watched())
        ft = [_steady(job.workers, STEADY_STEPS, [job.lighthouse])]
        per_round = [_round(job, r % 2) for r in range(rounds)]
        ft.append(_steady(job.workers, STEADY_STEPS))
        state_bytes = job.workers[0].commits()[max(job.workers[0].commits())]["nbytes"]
        for p in job.watched():
            p.kill()  # before the second plain window, which would share the cores with it
        plain.append(_plain_ddp(tmp, procs, "after"))
    except _Failed as exc:
        return {"unavailable": str(exc)}
    finally:
        for p in reversed(procs):
            p.kill()
        if job is not None:
            del job.stores
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "system": f"torchft {torchft_version}: Manager + DistributedDataParallel + Optimizer, ProcessGroupGloo, HTTP heal",
        "config": {
            "rounds": rounds,
            "groups": 2,
            "ranks_per_group": 1,
            "steady_steps": STEADY_STEPS,
            "lighthouse": "--min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 1000 (heartbeat_timeout_ms: default 5000)",
            "ddp_comm_hook": "torchft 0.2.0's own" if stock_hook else "torchft's, returning the bucket when the allreduce failed",
            "state_bytes": state_bytes,
        },
        **_summaries(per_round),
        **_overhead(plain, ft, ft[0]["helpers_cpu_per_step_s"]),
    }


if __name__ == "__main__":
    if len(sys.argv) > 1:
        _worker(sys.argv[1:])
    else:
        with tempfile.TemporaryDirectory() as d:
            print(json.dumps(measure(2, Path(d)), indent=1))
