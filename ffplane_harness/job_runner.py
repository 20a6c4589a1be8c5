"""Jobs of the example GPT script on a local cluster, one ``torchrun`` per node, as users launch
them — with the failures ffplane must survive and the recovery timeline read back from the
workers' event files (each worker runs under ``ffplane_harness.worker``, which attaches the
timeline's handler: ``ffplane_harness.timeline``). Used by ``ffplane demo``, the chaos soak and
``bench/recovery.py``; every process and shared-memory folder is ended by ``close()``.
"""

from __future__ import annotations

import bisect
import json
import os
import secrets
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from ffplane_contract.auth import TOKEN_ENV, bearer
from ffplane_contract.warm import readiness
from ffplane_harness.etcd_cluster import EtcdCluster
from ffplane_harness.local_cluster import LocalCluster
from ffplane_harness.netns import Netns
from ffplane_harness.torchrun import TorchrunNode
from ffplane_harness.worker import entry as worker_entry

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
EXAMPLE = EXAMPLES / "train_ffplane.py"
# the example jobs by model: the GPT under DDP, the same GPT sharded with FSDP2 (Checkpointer, or
# DCP through DaemonWriter/DaemonReader)
MODELS: dict[str, tuple[Path, list[str]]] = {
    "gpt": (EXAMPLE, []),
    "fsdp2": (EXAMPLES / "train_fsdp2.py", []),
    "fsdp2-dcp": (EXAMPLES / "train_fsdp2.py", ["--checkpoint", "dcp"]),
}
STAGES = ("detected", "restarted", "restored", "data_ready", "first_step")
# inside "restarted → restored", where a worker's start-up goes (ffplane's workers only)
STARTUP = ("imported", "restoring")


class LocalJobs:
    """A data server, node daemons and torchrun-launched jobs of ``script`` on this machine."""

    def __init__(self, work: Path, steps: int, nproc: int = 2, script: Path = EXAMPLE, net: Netns | None = None) -> None:
        """``net``: the data server in its node 0, daemon ``i`` and its torchrun in node
        ``i + 1``, and (``prepare(rendezvous="ffplane")``) the etcd members in its last three
        nodes, off the training nodes; else everything on loopback."""
        self.work, self.steps, self.nproc, self.script = work, steps, nproc, script
        self.token = secrets.token_hex(16)
        self.events_dir = work / "events"
        self.events_dir.mkdir(parents=True)
        self._events = _EventLog(self.events_dir)
        self.net = net
        self.cluster = LocalCluster(work, work / "datasets", self.token, net=net)
        self.nodes: list[TorchrunNode] = []
        self.max_restarts = 3  # per torchrun agent
        self.script_args: list[str] = []  # besides --job/--out/--steps
        self.warm = True  # restarted workers fork from a zygote with torch imported (warm_start)
        # the workers' per-step "batch" lines (an XXH3 of the batch and an append a step): the
        # chaos soak reads them; a benchmark that times steps turns them off
        self.batch_events = True
        # set by prepare(rendezvous="ffplane" or servers > 1): job records, coordination and (with
        # the ffplane rendezvous) torchrun's rendezvous in etcd (trainer_client.rendezvous)
        self.etcd: EtcdCluster | None = None
        self.rendezvous = "c10d"
        self.daemon_args: list[str] = []  # besides the budget, for every daemon started (restarts too)
        self.budget_mb = 512
        self._dataserver_args: list[str] = []
        self._coordinator: str | None = None  # the data server that answered status last

    # --- set-up --------------------------------------------------------------------------
    def prepare(
        self,
        jobs: list[str],
        daemons: int = 2,
        dp: int = 4,
        rows: int = 4096,
        budget_mb: int = 512,
        rendezvous: str = "c10d",
        servers: int = 1,
        daemon_args: list[str] | None = None,
    ) -> None:
        """A generated token dataset, ``servers`` data servers, ``daemons`` node daemons and
        ``jobs``; ``rendezvous="ffplane"`` or several servers also start a 3-member etcd cluster
        (torchrun's rendezvous; the servers' shared job records and coordination lease)."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.parquet as pq

        from dataserver.ingest import IngestConfig, ingest

        rng = np.random.default_rng(0)
        table = rng.integers(0, 512, size=(rows, 33), dtype=np.int64)
        pq.write_table(pa.table({"tokens": pa.array(list(table))}), self.work / "tokens.parquet")
        (self.work / "datasets").mkdir()
        ingest(IngestConfig([self.work / "tokens.parquet"], self.work / "datasets" / "tokens", progress=False))
        self.rendezvous, self.budget_mb, self.daemon_args = rendezvous, budget_mb, list(daemon_args or [])
        if rendezvous == "ffplane" or servers > 1:
            members = self.net.nodes[-3:] if self.net else []
            self.etcd = EtcdCluster(self.work, [m.addr for m in members] or None, [m.exec_argv for m in members] or None).start()
            self._dataserver_args = ["--etcd", self.etcd.endpoints]
        for i in range(servers):  # extra servers go in the namespaces just before etcd's
            self.start_dataserver(i)
        for _ in range(daemons):
            self.start_daemon()
        for job in jobs:
            self.post("/v1/jobs", {"name": job, "dataset": "tokens", "dp": dp, "batch_per_rank": 8, "seed": 0, "max_steps": self.steps})

    def start_dataserver(self, index: int, port: int = 0) -> None:
        """Data server ``index`` (or its restart, on ``port``), in its own namespace when there are any."""
        node = 0 if index == 0 or self.net is None else len(self.net.nodes) - 3 - index
        self.cluster.start_dataserver(*self._dataserver_args, port=port, index=index, node=node)

    def start_daemon(self, index: int | None = None) -> None:
        """Daemon ``index`` (default: the next; an index again: its restart, on the same root)."""
        self.cluster.start_daemon(*self.daemon_args, budget_mb=self.budget_mb, index=index)

    def coordinator_url(self) -> str:
        """The data server that coordinates (with one, that one)."""
        if self._coordinator is None:
            self._coordinator = self.cluster.leader().url
        return self._coordinator

    def _ask(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        headers = {**bearer(self.token), "Content-Type": "application/json"}
        for attempt in range(2):  # the coordinator may have changed: find it once more
            url = self.coordinator_url() + path
            req = urllib.request.Request(
                url, None if body is None else json.dumps(body).encode(), headers, method="GET" if body is None else "POST"
            )
            try:
                result: dict[str, Any] = json.loads(urllib.request.urlopen(req, timeout=10).read())
                return result
            except urllib.error.HTTPError as exc:
                if exc.code not in (421, 503) or attempt:
                    raise
            except OSError:
                if attempt:
                    raise
            self._coordinator = None
        raise AssertionError("unreachable")

    def post(self, path: str, body: dict[str, Any]) -> None:
        self._ask(path, body)

    def status(self, job: str) -> dict[str, Any]:
        """The job's status from the coordinator ({} while a new coordinator settles)."""
        try:
            return self._ask(f"/v1/jobs/{job}/status")
        except urllib.error.HTTPError as exc:
            if exc.code == 503:
                return {}
            raise

    # --- workers ---------------------------------------------------------------------------
    def launch(self, job: str, daemon: int, endpoint: str, log_name: str, nnodes: int = 2, prestart: bool = False) -> TorchrunNode:
        """torchrun for one node of ``job``, its workers using daemon ``daemon`` (``prestart``:
        its zygote started first, a warm spare)."""
        assert self.cluster.dataserver is not None
        (self.work / job).mkdir(exist_ok=True)
        (self.events_dir / job).mkdir(exist_ok=True)
        env = {
            "FFPLANE_NODE": f"n{daemon}",
            "FFPLANE_DATASERVER": self.cluster.dataserver_urls,
            TOKEN_ENV: self.token,
            "FFPLANE_DAEMON_SOCKET": str(self.cluster.socket(daemon)),
        }
        place = self.net.nodes[daemon + 1] if self.net else None
        if place is not None:  # gloo binds the node's own link, not the host name's loopback
            env["GLOO_SOCKET_IFNAME"] = place.iface
        node = TorchrunNode(
            self.script,
            ["--job", job, "--out", str(self.work / job), "--steps", str(self.steps), *self.script_args],
            endpoint,
            job,
            nnodes=nnodes,
            nproc=self.nproc,
            log=self.work / f"{log_name}-n{daemon}.log",
            env=env,
            max_restarts=self.max_restarts,
            host=not any(n.running() and n.run_id == job for n in self.nodes),
            rdzv=self.rendezvous,
            local_addr=place.addr if place else "127.0.0.1",
            wrap=place.exec_argv if place else None,
            # a new node starts cold, and another LocalJobs of this process has zygotes of its own
            warm_dir=Path(f"/dev/shm/ffw-{os.getpid()}-{self.cluster.serial}-{len(self.nodes)}") if self.warm else None,
            entry=worker_entry(self.events_dir / job, batches=self.batch_events),
        )
        if prestart and node.warm_dir is not None:
            node.prestart()
        self.nodes.append(node.start())
        return node

    def launch_job(self, job: str, daemons: list[int]) -> list[TorchrunNode]:
        endpoint = self.etcd.endpoints if self.rendezvous == "ffplane" and self.etcd else f"127.0.0.1:{_free_port()}"
        return [self.launch(job, d, endpoint, job, nnodes=len(daemons)) for d in daemons]

    def launch_spare(self, job: str, daemon: int, nodes: list[TorchrunNode]) -> TorchrunNode:
        """A warm spare for the running ``nodes`` of ``job``: its zygote started, its agent
        waiting beyond ``--nnodes`` (torch's redundancy list) to take a lost node's place."""
        assert self.rendezvous == "ffplane", "warm spares wait in the ffplane rendezvous: prepare(rendezvous='ffplane')"
        return self.launch(job, daemon, nodes[0].endpoint, job, nnodes=nodes[0].nnodes, prestart=True)

    def node_of(self, nodes: list[TorchrunNode], name: str) -> TorchrunNode:
        """The running torchrun of node ``name`` (``n<daemon>``) among ``nodes``."""
        return next(n for n in nodes if n.env.get("FFPLANE_NODE") == name and n.running())

    def saved_steps(self, since: float, job: str | None = None, until: float = float("inf")) -> dict[int, int]:
        """rank → newest step it saved (of ``job``) between ``since`` and ``until``."""
        return self._events.saved(job, since, until)

    def events(self, job: str | None = None) -> list[dict[str, Any]]:
        """Every worker's events (of ``job``), oldest first, each with its ``job``."""
        return self._events.read(job)

    def wait_step(self, nodes: list[TorchrunNode], step: int, since: float, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while min(self.saved_steps(since).values(), default=-1) < step or len(self.saved_steps(since)) < self.world(nodes):
            if time.monotonic() > deadline or any(n.popen is not None and n.popen.poll() not in (None, 0) for n in nodes):
                raise RuntimeError(f"the job did not reach step {step}; logs in {self.work}")
            time.sleep(0.05)

    def wait_done(self, nodes: list[TorchrunNode], timeout_s: float = 180) -> None:
        for n in nodes:
            if n.wait(timeout_s) != 0:
                raise RuntimeError(f"torchrun on a node failed; logs in {self.work}")

    # --- failures ------------------------------------------------------------------------
    def timeline(self, kind: str, failed_at: float, detected_at: float, saved_before: int, job: str | None = None) -> dict[str, Any]:
        """Seconds from the failure to each stage (the slowest rank), and the steps lost. Stages:
        detected (``detected_at``), restarted (the last new process), restored, data ready, first
        step done, caught up (every rank past ``saved_before``, the newest step done before the
        failure: the lost steps redone)."""
        ev = [e for e in self.events(job) if e["t"] >= failed_at]
        restored = [e for e in ev if e["kind"] == "restored"]
        if not restored:
            raise RuntimeError(f"no rank restored after the {kind}; logs in {self.work}")
        step = min(e["step"] for e in restored)
        resumed = min(e["t"] for e in restored)
        first: dict[int, float] = {}
        back: dict[int, float] = {}
        for e in ev:
            if e["kind"] != "saved" or e["t"] < resumed:  # a lagging rank's step before the restart does not count
                continue
            if e["step"] == step + 1:
                first.setdefault(e["rank"], e["t"])
            if e["step"] > saved_before:  # saved_before + 1, or later if the restore was newer
                back.setdefault(e["rank"], e["t"])
        stamps = {
            "detected": detected_at,
            "restarted": max(e["t"] for e in ev if e["kind"] == "process_start"),
            "restored": max(e["t"] for e in restored),
            "data_ready": max(e["t"] for e in ev if e["kind"] == "data_ready"),
            "first_step": max(first.values()),
        }
        for stage in STARTUP:
            if times := [e["t"] for e in ev if e["kind"] == stage]:
                stamps[stage] = max(times)
        if not back:
            raise RuntimeError(
                f"no rank saved a step past {saved_before} after the {kind} yet: wait for step {saved_before + 2} before taking its timeline"
            )
        stamps["caught_up"] = max(back.values())
        return {
            "failure": kind,
            "restored_step": step,
            "steps_lost": steps_lost(saved_before, step),
            "seconds": {k: round(v - failed_at, 3) for k, v in stamps.items()},
        }

    def world(self, nodes: list[TorchrunNode]) -> int:
        return len(nodes) * self.nproc

    def worker_pid(self, node: str, since: float, job: str | None = None) -> int:
        """A worker of ``job`` running on ``node`` (the newest to save there)."""
        return int(next(e["pid"] for e in reversed(self.events(job)) if e["kind"] == "saved" and e["node"] == node and e["t"] >= since))

    def until(self, fn: Any, timeout_s: float = 60) -> float:
        deadline = time.monotonic() + timeout_s
        while not fn():
            if time.monotonic() > deadline:
                raise RuntimeError(f"gave up waiting after {timeout_s}s; logs in {self.work}")
            time.sleep(0.02)
        return time.time()

    def until_warm(self, nodes: list[TorchrunNode], timeout_s: float = 120) -> None:
        """Until every running node's zygote has torch imported: the first workers start it
        beside themselves, and a failure before it is ready restarts cold (and on one machine its
        import takes the cores the restart needs)."""
        warm = [n.warm_dir for n in nodes if n.warm_dir is not None and n.running()]
        self.until(lambda: all(readiness(d)["ready"] for d in warm), timeout_s=timeout_s)

    def close(self) -> None:
        for node in self.nodes:
            node.kill()
        self.cluster.close()
        if self.etcd is not None:
            self.etcd.close()


class _EventLog:
    """The workers' event files, read incrementally: a long soak polls them ten times a second,
    and re-reading every line of a run with ~10^5 events each time took a core from the job.
    A file is opened only when it grew, and "saved" lines are also kept per rank in time order,
    so the soak's polls (``saved``) look at a slice, not at every event: a 1,000-failure run
    has ~1,500 event files and ~2 x 10^5 events."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._read: dict[str, int] = {}  # file → bytes parsed (whole lines)
        self._merged: dict[str, list[dict[str, Any]]] = {}  # job → its events, oldest first
        self._saves: dict[str, dict[int, tuple[list[float], list[int]]]] = {}  # job → rank → (times, steps), by time
        self._finished: set[str] = set()  # files whose writer has exited and that were read to the end
        self._polls = 0

    def read(self, job: str | None) -> list[dict[str, Any]]:
        if job is None:
            return sorted((e for j in self._jobs() for e in self.read(j)), key=_time)
        return list(self._ingest(job))  # the caller's to keep; the log goes on growing

    def saved(self, job: str | None, since: float, until: float) -> dict[int, int]:
        """rank → the newest step among its "saved" lines between ``since`` and ``until``."""
        newest: dict[int, int] = {}
        for j in self._jobs() if job is None else [job]:
            self._ingest(j)
            for rank, (times, steps) in self._saves.get(j, {}).items():
                lo, hi = bisect.bisect_left(times, since), bisect.bisect_right(times, until)
                if lo < hi:
                    newest[rank] = max(newest.get(rank, -1), max(steps[lo:hi]))
        return newest

    def _jobs(self) -> list[str]:
        return [d.name for d in self.root.iterdir() if d.is_dir()]

    def _ingest(self, job: str) -> list[dict[str, Any]]:
        merged = self._merged.setdefault(job, [])
        new: list[dict[str, Any]] = []
        self._polls += 1
        if self._polls % 50 == 0:
            self._finished.clear()  # now and then every file again: a writer in another pid namespace
        live = {int(p) for p in os.listdir("/proc") if p.isdigit()}
        folder = os.path.join(self.root, job)
        names = os.listdir(folder) if os.path.isdir(folder) else []  # not Path.glob: 4 ms for 1,500 files
        for name in names:
            if not (name.startswith("events-") and name.endswith(".jsonl")):
                continue
            f = os.path.join(folder, name)
            writer = int(name[len("events-") : -len(".jsonl")])  # events-<pid>.jsonl
            if writer in live:
                self._finished.discard(f)  # (a pid used again writes on in the same file)
            elif f in self._finished:
                continue  # most files: their workers are gone and every line is read
            else:
                self._finished.add(f)  # read once more, to the end, below
            at = self._read.get(f, 0)
            try:
                if os.stat(f).st_size <= at:
                    continue
            except FileNotFoundError:
                continue
            with open(f, "rb") as fh:
                fh.seek(at)
                data = fh.read()
            whole = data[: data.rfind(b"\n") + 1]  # a line being written waits for the next read
            self._read[f] = at + len(whole)
            for line in whole.splitlines():
                try:
                    new.append({**json.loads(line), "job": job})
                except ValueError:
                    continue
        if new:
            new.sort(key=_time)
            # only the tail from the oldest new event is re-sorted: other workers' newest lines
            # may be later than it, the rest of the log is not
            at = bisect.bisect_right(merged, new[0]["t"], key=_time)
            merged[at:] = sorted(merged[at:] + new, key=_time)
            saves = self._saves.setdefault(job, {})
            for e in new:
                if e["kind"] == "saved":
                    times, steps = saves.setdefault(int(e["rank"]), ([], []))
                    i = bisect.bisect_right(times, e["t"])
                    times.insert(i, float(e["t"]))
                    steps.insert(i, int(e["step"]))
        return merged


def _time(event: dict[str, Any]) -> float:
    return float(event["t"])


def steps_lost(done_before: int, restored_step: int) -> int:
    """Steps a failure cost: the newest step done before it (by the workers' "saved" lines) less
    the step restored. A worker SIGKILLed between committing a step and writing its line leaves
    that step restorable with no line before the failure: none lost, not -1."""
    return max(0, done_before - restored_step)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
