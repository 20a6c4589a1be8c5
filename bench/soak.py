"""Chaos soak: the example GPT job (2 nodes x 2 workers, one torchrun per node) under random
failures every few steps — worker SIGKILL, daemon SIGKILL (restarted on the same shared memory),
node loss (torchrun, workers, daemon and shared memory gone; a replacement node joins), link cut,
data-server restart, a corrupt copy (bytes flipped in the newest slot of a role, and half the
time in its replica too, then a worker SIGKILLed so a restore meets it), a damaged index (the
daemon SIGKILLed, its LMDB index garbled or deleted, restarted) and a successor that stops
answering but keeps beating (its port drops every packet until the job has recovered) — then checks what the mission promises: every failure recovered, at
most one lost step each, every batch of the final history the one the failure-free run used
(every sample exactly once), and final weights bitwise-equal to that run.

    python bench/soak.py --failures 200        # the full soak (about an hour here)
    python bench/soak.py --failures 5          # what CI runs (tests/test_soak.py)
    python bench/soak.py --failures 16 --model fsdp2 --out soak_fsdp2   # the FSDP2 GPT (or fsdp2-dcp)
    python bench/soak.py --failures 1000 --kinds all --data-servers 2 --rendezvous ffplane \
        --durable-every 4 --steps 16000 --out soak_1000   # every kind, thirteen (~2.5 h here)

``--kinds all`` adds what needs more of the deployment: the coordinating data server SIGKILLed
(another takes over; a supervisor restarts it), the node whose agent holds the workers' store lost
(the ffplane rendezvous keeps no state on it), a worker SIGKILLed and its replacement SIGKILLed
again once it reports ``restoring``, a worker SIGKILLed as an elastic re-plan (a new generation)
is posted, two warm spares taking over one after the other (the rank-0 node lost, then the other;
``--rendezvous ffplane``), and a node lost with its ring successor (with two nodes, both:
the job is launched again on two new nodes and restores from the durable tier, up to
2 x ``--durable-every`` - 1 steps back (the copy of the newest multiple may be in flight), each
worker logging that it does; counted apart from the at-most-one-lost-step figure).

Writes bench/results/soak.json (failures by kind, recovered, lost steps, data exactly-once,
bitwise_equal, and every failure's record).

"Link cut" on one machine: the node's processes (daemon, torchrun agent, workers) are frozen with
SIGSTOP for longer than the coordinator's dead-after, then resumed — the node drops out of the
ring, its peers block in their collectives, and it rejoins. A cut made with ``ip link set down``
in network namespaces is in tests/trainer_client/test_node_loss.py (our launcher, not torchrun).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import urllib.error
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from urllib.parse import urlsplit  # noqa: E402

from bench import _faults  # noqa: E402
from bench._common import RESULTS  # noqa: E402
from ffplane_harness.job_runner import MODELS, LocalJobs, steps_lost  # noqa: E402
from ffplane_harness.torchrun import TorchrunNode  # noqa: E402
from statestore.slots import version_key  # noqa: E402
from trainer_client.warm_start import descendants  # noqa: E402

KINDS = (
    "worker_kill",
    "daemon_kill",
    "node_loss",
    "link_cut",
    "dataserver_restart",
    "corrupt_copy",
    "damage_index",
    "successor_unreachable",
    "header_corruption",
    "bulk_abuse",
)
# Kinds that need more of the deployment (``--kinds all`` takes them with the rest; see the
# module docstring): coordinator_kill (--data-servers 2), rendezvous_host_loss (--rendezvous
# ffplane), kill_during_restore, kill_during_replan and node_and_successor (--durable-every N).
EXTRA_KINDS = (
    "coordinator_kill",
    "rendezvous_host_loss",
    "kill_during_restore",
    "kill_during_replan",
    "node_and_successor",
    "spare_takeovers",
)
NEEDS = {
    "coordinator_kill": ("data_servers", "--data-servers 2"),
    "rendezvous_host_loss": ("ffplane", "--rendezvous ffplane"),
    "spare_takeovers": ("ffplane", "--rendezvous ffplane"),
    "node_and_successor": ("durable", "--durable-every N"),
}
JOB, REFERENCE = "soak", "reference"


class Soak(LocalJobs):
    def __init__(self, work: Path, steps: int, seed: int, model: str = "gpt") -> None:
        script, script_args = MODELS[model]
        super().__init__(work, steps, script=script)
        self.script_args = list(script_args)
        self.max_restarts = 100_000
        self.recovery_timeout_s = 120.0
        self.rng = random.Random(seed)
        self.placement: list[int] = [0, 1]  # torchrun node position → daemon index
        self.records: list[dict[str, Any]] = []
        self._heal: list[Any] = []  # undone once the job has recovered (a port made unreachable)
        self._note: dict[str, Any] = {}  # what the last failure adds to its record

    def progressed(self, nodes: list[TorchrunNode], beyond: int, since: float, timeout_s: float = 180) -> bool:
        """Whether every rank saved a step past ``beyond`` after ``since`` (or the job finished)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            s = self.saved_steps(since, JOB)
            if len(s) == self.world(nodes) and min(s.values()) > beyond:
                return True
            if all(n.popen is not None and n.popen.poll() == 0 for n in nodes):
                return True
            time.sleep(0.1)
        return False

    # --- failures ------------------------------------------------------------------------
    def inject(self, kind: str, nodes: list[TorchrunNode]) -> float:
        """Inject one failure; when it hit (wall clock)."""
        pos = self.rng.randrange(len(nodes))
        hit = time.time()
        if kind == "worker_kill":
            # the victim is chosen first: reading every event file takes long enough for a step
            # to finish before the kill, which then counted as "-1 steps lost"
            victim = self.worker_pid(f"n{self.placement[pos]}", time.time() - 30, JOB)
            hit = time.time()
            os.kill(victim, signal.SIGKILL)
        elif kind == "daemon_kill":
            d = self.placement[pos]
            self.cluster.daemons[self._daemon_slot(d)].kill()
            self.start_daemon(d)
        elif kind == "node_loss":
            # position 0's agent hosts the c10d rendezvous store: torchrun's one point of failure
            # (the ffplane rendezvous removes it: rendezvous_host_loss); this loses the other node
            hit = self._lose(nodes, 1)
        elif kind == "link_cut":
            d = self.placement[pos]
            # a coordinator restarted a moment ago learns the job's nodes from their next full
            # heartbeat; a node it does not know yet cannot be declared dead by it
            self.until(lambda: f"n{d}" in self.status(JOB).get("ring", []), timeout_s=30)
            daemon_pid = self.cluster.daemons[self._daemon_slot(d)].pid
            nodes[pos].freeze()
            os.kill(daemon_pid, signal.SIGSTOP)
            try:
                self.until(lambda: f"n{d}" in self.status(JOB).get("dead", []), timeout_s=30)
            finally:
                nodes[pos].thaw()
                os.kill(daemon_pid, signal.SIGCONT)
        elif kind == "dataserver_restart":
            assert self.cluster.dataserver is not None
            port = int(self.cluster.dataserver.ready["port"])  # type: ignore[call-overload]
            self.cluster.dataserver.kill()
            self.start_dataserver(0, port)
        elif kind == "coordinator_kill":  # the coordinating one of several: another takes over; a supervisor restarts it
            leader = self.cluster.leader()
            slot = self.cluster.dataservers.index(leader)
            port = int(leader.ready["port"])  # type: ignore[call-overload]
            leader.kill()
            self._coordinator = None
            self.start_dataserver(slot, port)
        elif kind == "rendezvous_host_loss":
            rank0 = next(e["node"] for e in reversed(self.events(JOB)) if e["kind"] == "saved" and e["rank"] == 0)
            hit = self._lose(nodes, next(i for i, d in enumerate(self.placement) if f"n{d}" == rank0))
        elif kind == "kill_during_restore":
            node = f"n{self.placement[pos]}"
            os.kill(self.worker_pid(node, time.time() - 30, JOB), signal.SIGKILL)
            # the replacement reports "restoring" once its process group is up: kill it there
            again = self.until(lambda: self._restoring(node, hit) is not None, timeout_s=60)
            os.kill(int(self._restoring(node, hit) or 0), signal.SIGKILL)
            self._note = {"second_kill_after_s": round(again - hit, 2)}
        elif kind == "kill_during_replan":
            hit = self._replan_and_kill(f"n{self.placement[pos]}")
        elif kind == "node_and_successor":
            hit = self._lose_all(nodes)
        elif kind == "spare_takeovers":
            hit = self._spare_takeovers(nodes)
        elif kind == "corrupt_copy":
            hit = self._corrupt_and_kill(pos, nodes)
        elif kind == "damage_index":
            d = self.placement[pos]
            self.cluster.daemons[self._daemon_slot(d)].kill()
            index = self.cluster.roots[d] / "_index"
            if self.rng.random() < 0.5:
                data = index / "data.mdb"
                data.write_bytes(self.rng.randbytes(data.stat().st_size))  # garbled: LMDB refuses it
            else:
                shutil.rmtree(index)  # gone: the daemon would forget every slot
            self.start_daemon(d)
        elif kind == "successor_unreachable":
            d = self.placement[pos]
            proc = self.cluster.daemons[self._daemon_slot(d)]
            port = int(proc.ready["port"])  # type: ignore[call-overload]
            _faults.unreachable(proc.pid)  # every port (HTTP, bulk); it keeps beating: only its peers cannot reach it
            self._heal.append(lambda: self._reachable_again(d, proc, port))
        elif kind == "header_corruption":
            hit = self._damage_header_and_kill(pos, nodes)
        elif kind == "bulk_abuse":  # while the node trains and takes replicas; closed once the job has gone on
            daemon = self.cluster.daemons[self._daemon_slot(self.placement[pos])]
            port = self.get(daemon.url + "/v1/transfer", auth=True)["bulk_port"]
            opened = _faults.bulk_abuse(urlsplit(daemon.url).hostname or "127.0.0.1", int(port), self.cluster.token, self.rng)
            self._heal.append(functools.partial(_faults.close_all, opened))
        else:
            raise ValueError(f"unknown failure kind {kind!r}; choose from {KINDS}")
        return hit

    def _damage_header_and_kill(self, pos: int, nodes: list[TorchrunNode]) -> float:
        """``_damage_newest_and_kill`` where the damage is one digit of the newest version's tree
        changed in the node's index while its daemon is down: the restore meets a header that no
        longer matches its digest and takes the replica."""

        def damage(d: int, daemon: Any, role: str, newest: dict[str, Any], replica: Path) -> None:
            daemon.kill()
            self._note = {
                "header_damaged": _faults.damage_tree(self.cluster.roots[d] / "_index", version_key(JOB, role, newest["step"]), self.rng)
            }
            self.start_daemon(d)

        return self._damage_newest_and_kill(pos, nodes, damage)

    def _lose(self, nodes: list[TorchrunNode], pos: int) -> float:
        """Node ``pos`` is gone (torchrun, workers, daemon, shared memory); a replacement joins."""
        old, endpoint = self.placement[pos], nodes[pos].endpoint
        hit = time.time()
        nodes[pos].kill()
        self.cluster.lose_node(old)
        new = len(self.cluster.roots)
        self.start_daemon(new)
        self.until(lambda: f"n{new}" in self.status(JOB).get("ring", []))
        nodes[pos] = self.launch(JOB, new, endpoint, JOB)
        self.placement[pos] = new
        return hit

    def _spare_takeovers(self, nodes: list[TorchrunNode]) -> float:
        """A warm spare takes the rank-0 node's place (torchrun re-ranks: roles move between
        nodes), then a second spare the other node's: the loss after a takeover went ~30 steps
        back when a node re-sent versions of a role it no longer ran. The first loss is in the
        record as ``takeover_*``; the failure's own figures are the second's."""
        hit, first = 0.0, {}
        for stage in range(2):
            spare_d = len(self.cluster.roots)
            self.start_daemon(spare_d)
            self.until(lambda: f"n{spare_d}" in self.status(JOB).get("ring", []))
            spare = self.launch_spare(JOB, spare_d, nodes)  # returns once its zygote has torch imported
            now = time.time()
            # its agent then starts and joins torch's redundancy list (a failure while it is still
            # starting is another scenario: see the issue-39 note)
            if not self.progressed(nodes, max(self.saved_steps(0, JOB).values()) + 12, now):
                raise RuntimeError(f"the job stopped while a spare joined; logs in {self.work}")
            if stage == 0:
                rank0 = next(e["node"] for e in reversed(self.events(JOB)) if e["kind"] == "saved" and e["rank"] == 0)
                pos = next(i for i, d in enumerate(self.placement) if f"n{d}" == rank0)
            else:
                pos = 1 - pos  # the node the first spare did not replace
            hit = time.time()
            saved_before = max(self.saved_steps(0, JOB, until=hit).values())
            nodes[pos].kill()
            self.cluster.lose_node(self.placement[pos])
            nodes[pos], self.placement[pos] = spare, spare_d
            if stage == 0:
                recovered = self.progressed(nodes, saved_before + 1, hit, timeout_s=self.recovery_timeout_s)
                restored = [e for e in self.events(JOB) if e["kind"] == "restored" and e["t"] >= hit]
                lost = steps_lost(saved_before, restored[0]["step"]) if restored else 0
                first = {"takeover_recovered": recovered, "takeover_steps_lost": lost, "takeover_s": round(time.time() - hit, 2)}
                if not recovered:
                    break
                self._until_redundant()
        self._note = first
        return hit

    def _lose_all(self, nodes: list[TorchrunNode]) -> float:
        """A node and its ring successor at once — with two nodes, both: every in-memory copy of
        the job's state is gone, the job is launched again on two new nodes and must restore from
        the durable tier (a clear warning, up to --durable-every steps back)."""
        hit = time.time()
        for pos in range(len(nodes)):
            nodes[pos].kill()
            self.cluster.lose_node(self.placement[pos])
        fresh = []
        for _ in nodes:
            fresh.append(len(self.cluster.roots))
            self.start_daemon(fresh[-1])
        self.until(lambda: all(f"n{d}" in self.status(JOB).get("ring", []) for d in fresh))
        self.placement = fresh
        nodes[:] = self.launch_job(JOB, fresh)
        return hit

    def _replan_and_kill(self, node: str) -> float:
        """Post a new generation a few steps ahead (every node's cache re-plans from it) and
        SIGKILL a worker of ``node`` at once: the restart meets the re-plan mid-way."""
        victim = self.worker_pid(node, time.time() - 30, JOB)
        start = max(self.saved_steps(time.time() - 60, JOB).values()) + 3
        for _ in range(5):  # training may pass the chosen step before the post lands: a later one
            try:
                self.post(f"/v1/jobs/{JOB}/generations", {"start_step": start, "dp": 4, "batch_per_rank": 8, "replan_served": True})
                break
            except urllib.error.HTTPError as exc:
                if exc.code != 409:
                    raise
                start += 3
        else:
            raise RuntimeError(f"no generation could be added ahead of the job; logs in {self.work}")
        hit = time.time()
        os.kill(victim, signal.SIGKILL)
        self._note = {"replan_at_step": start}
        return hit

    def _restoring(self, node: str, since: float) -> int | None:
        """The pid of a worker on ``node`` that began restoring after ``since``, if any."""
        return next((int(e["pid"]) for e in self.events(JOB) if e["kind"] == "restoring" and e["node"] == node and e["t"] > since), None)

    def _until_redundant(self, timeout_s: float = 60) -> None:
        """Wait until both nodes replicate to each other again and trail by at most a commit.
        Two nodes are a ring of two: while one cannot be reached, the other's commits have no
        copy anywhere else (answered after a short wait, by design), and losing it then is a
        double fault no one-replica scheme survives. The soak injects one failure at a time:
        the next only once the previous one's redundancy is back."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                states = [self.get(self.cluster.daemons[self._daemon_slot(d)].url + "/v1/state")["replication"] for d in self.placement]
            except (OSError, RuntimeError, ValueError):
                states = []
            lags = [
                r["committed"] - r["replicated"] if r["replicated"] is not None else None
                for st in states
                if st and st["successor"] is not None
                for key, r in st["roles"].items()
                if key.startswith(f"{JOB}/")
            ]
            if (
                len(states) == len(self.placement)
                and all(st and st["successor"] for st in states)
                and lags
                and all(lag is not None and lag <= 1 for lag in lags)
            ):
                return
            time.sleep(0.2)
        print("  redundancy not back within 60 s; injecting anyway", flush=True)

    def _reachable_again(self, d: int, proc: Any, port: int) -> None:
        """Let the daemon's port answer again; if it still does not (it should), restart it."""
        import urllib.request

        if proc.popen.poll() is not None:
            return
        _faults.heal(proc.pid)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(proc.url + "/v1/health", timeout=1).read()
                return
            except OSError:
                time.sleep(0.2)
        print(f"  n{d}'s port did not answer after the heal: restarting its daemon", flush=True)
        self.records[-1]["healed_by_restart"] = True
        proc.kill()
        self.start_daemon(d)

    def _corrupt_and_kill(self, pos: int, nodes: list[TorchrunNode]) -> float:
        """``_damage_newest_and_kill`` where the damage is bytes flipped in one copy: the slot, or
        half the time the replica on the other node."""

        def damage(d: int, daemon: Any, role: str, newest: dict[str, Any], replica: Path) -> None:
            if self.rng.random() < 0.5:
                _faults.flip(replica, newest["nbytes"] // 3)
            else:
                _faults.flip(self.cluster.roots[d] / newest["slot"], newest["nbytes"] // 2)

        return self._damage_newest_and_kill(pos, nodes, damage)

    def _damage_newest_and_kill(self, pos: int, nodes: list[TorchrunNode], damage: Callable[..., None]) -> float:
        """Damage one copy of the newest committed version of a role on the node (``damage(node,
        daemon, role, version, replica path)``), then SIGKILL a worker: the restore that follows
        meets the damage. The node is frozen meanwhile, so the damaged version stays the newest.
        One copy, and only where its replica has landed: a version whose commit is still
        unanswered has one copy, and damaging it — like damaging every copy of a step — is a
        second, independent fault (an earlier run that did it half the time lost 2 steps where a
        worker had just finished the next all-reduce)."""
        d = self.placement[pos]
        victim = self.worker_pid(f"n{d}", time.time() - 30, JOB)
        nodes[pos].freeze()
        try:
            daemon = self.cluster.daemons[self._daemon_slot(d)]
            roles = [r for r in self.get(daemon.url + "/v1/state")["roles"] if r["job"] == JOB and r["versions"]]
            role = self.rng.choice(roles)
            newest = role["versions"][0]
            replica = self.cluster.roots[self.placement[1 - pos]] / JOB / "replica" / role["role"] / f"{newest['step']:012d}.bin"
            if replica.exists():
                damage(d, daemon, role["role"], newest, replica)
            hit = time.time()
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:  # it ended as it was chosen (a restart under way): kill the newest live one
                _faults.kill_newest_worker(lambda: self.worker_pid(f"n{d}", time.time() - 30, JOB))
        finally:
            nodes[pos].thaw()
        return hit

    def get(self, url: str, auth: bool = False) -> dict[str, Any]:
        import urllib.request

        headers = {"Authorization": f"Bearer {self.cluster.token}"} if auth else {}
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as resp:
            result: dict[str, Any] = json.loads(resp.read())
            return result

    def _daemon_slot(self, index: int) -> int:
        """Position in ``cluster.daemons`` of the live daemon for node ``n<index>``."""
        for i in range(len(self.cluster.daemons) - 1, -1, -1):
            p = self.cluster.daemons[i]
            if p.ready.get("node_id") == f"n{index}" and p.popen.poll() is None:
                return i
        raise RuntimeError(f"no live daemon for n{index}")

    # --- the run -------------------------------------------------------------------------
    def run(self, failures: int, kinds: tuple[str, ...]) -> dict[str, Any]:
        print(f"[1/3] failure-free reference run, {self.steps} steps", flush=True)
        self.wait_done(self.launch_job(REFERENCE, self.placement), timeout_s=max(180, self.steps))
        print(f"[2/3] the same job with {failures} failures", flush=True)
        started = time.time()
        nodes = self.launch_job(JOB, self.placement)
        order = [kinds[i % len(kinds)] for i in range(failures)]
        self.rng.shuffle(order)
        for i, kind in enumerate(order):
            gap = self.rng.randint(2, 5)  # steps between recovery and the next failure
            newest = max(self.saved_steps(started, JOB).values(), default=-1)
            if not self.progressed(nodes, newest + gap - 1, started):
                raise RuntimeError(f"the job stopped before failure {i}; logs in {self.work}")
            saved_before = max(self.saved_steps(started, JOB).values())
            if saved_before >= self.steps - (100 if kind == "spare_takeovers" else 3):  # two spares start during one
                print(f"  the job is nearly done after {i} failures: raise --steps", flush=True)
                break
            self._until_redundant()
            failed_at = self.inject(kind, nodes)
            recovered = self.progressed(nodes, saved_before + 1, failed_at, timeout_s=self.recovery_timeout_s)
            restored = [e for e in self.events(JOB) if e["kind"] == "restored" and e["t"] >= failed_at]
            # the newest step done when the failure hit (training went on while it was chosen)
            done_before = max(self.saved_steps(started, JOB, until=failed_at).values())
            rec: dict[str, Any] = {
                "kind": kind,
                "recovered": recovered,
                "saved_before": done_before,
                "restored_step": restored[0]["step"] if restored else None,
                "steps_lost": steps_lost(done_before, restored[0]["step"]) if restored else 0,
                "seconds_to_progress": round(time.time() - failed_at, 2),
            }
            if kind == "node_and_successor":  # the workers said where their state came from
                logs = "".join(p.read_text(errors="replace") for p in self.work.glob(f"{JOB}-n*.log"))
                rec["durable_warning"] = "from the durable tier" in logs
            rec.update(self._note)
            self._note = {}
            if "takeover_steps_lost" in rec:  # two losses in one failure: the worse counts
                rec["steps_lost"] = max(int(rec["steps_lost"] or 0), int(rec["takeover_steps_lost"]))
                recovered = bool(recovered and rec["takeover_recovered"])
                rec["recovered"] = recovered
            self.records.append(rec)
            for undo in self._heal:
                undo()
            self._heal.clear()
            print(f"  {i + 1:4d} {kind:20s} recovered={recovered} lost={rec['steps_lost']} ({rec['seconds_to_progress']} s)", flush=True)
            if (i + 1) % 100 == 0:  # a job too short ends the run before its failures: say so while there is time
                need = done_before / (i + 1) * len(order)
                warn = "; the job will end first: raise --steps" if need > self.steps - 3 else ""
                print(
                    f"  {done_before / (i + 1):.1f} steps a failure so far: ~{need:,.0f} of {self.steps:,} steps needed{warn}", flush=True
                )
            if not recovered:
                self.diagnose()
                break
        print("[3/3] waiting for the job to finish; checking data and weights", flush=True)
        if self.records and not self.records[-1]["recovered"]:
            raise RuntimeError(f"failure {len(self.records)} ({self.records[-1]['kind']}) was not recovered; logs in {self.work}")
        self.wait_done(nodes, timeout_s=max(300, self.steps))
        return self.summary()

    def diagnose(self) -> None:
        """What every worker and daemon is doing (the job did not recover): into the work folder."""
        import subprocess
        import urllib.request

        with open(self.work / "diagnosis.txt", "w") as out:
            for n in self.nodes:
                if n.running() and n.popen is not None:
                    for pid in descendants(n.popen.pid):
                        out.write(subprocess.run(["py-spy", "dump", "--native", "--pid", str(pid)], capture_output=True, text=True).stdout)
            for d in self.cluster.daemons:
                if d.popen.poll() is None:
                    for path in ("/v1/state", "/v1/gate"):
                        try:
                            out.write(f"{d.url}{path}: {urllib.request.urlopen(d.url + path, timeout=3).read().decode()}\n")
                        except OSError as exc:
                            out.write(f"{d.url}{path}: {exc}\n")
        print(f"  diagnosis in {self.work / 'diagnosis.txt'}", flush=True)

    def summary(self) -> dict[str, Any]:
        import torch

        a, b = torch.load(self.work / JOB / "final.pt"), torch.load(self.work / REFERENCE / "final.pt")
        bitwise = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        exactly_once, detail = self.data_exactly_once()
        recs = self.records
        memory = [r for r in recs if r["kind"] != "node_and_successor"]  # restored from another node's memory
        durable = [r for r in recs if r["kind"] == "node_and_successor"]
        return {
            "failures": len(recs),
            "by_kind": dict(Counter(r["kind"] for r in recs)),
            "recovered": sum(r["recovered"] for r in recs),
            "unrecoverable": sum(not r["recovered"] for r in recs),
            "lost_steps": {
                "total": sum(r["steps_lost"] for r in memory),
                "max": max((r["steps_lost"] for r in memory), default=0),
                "by_kind": {k: max(r["steps_lost"] for r in recs if r["kind"] == k) for k in {r["kind"] for r in recs}},
            },
            # a node and its successor at once: no copy in any memory; bounded by --durable-every
            "durable_fallback": {
                "failures": len(durable),
                "max_lost": max((r["steps_lost"] for r in durable), default=0),
                "warned": all(r.get("durable_warning") for r in durable),
            },
            "data_exactly_once": exactly_once,
            "data_detail": detail,
            "bitwise_equal": bitwise,
            "steps": self.steps,
            "records": recs,
        }

    def data_exactly_once(self) -> tuple[bool, str]:
        """The batch each rank trained on at each step of the final history (the last time that
        step was served) is the failure-free run's, and every step is there once."""

        def history(job: str) -> dict[tuple[int, int], str]:
            last: dict[tuple[int, int], str] = {}
            for e in self.events(job):
                if e["kind"] == "batch":
                    last[(e["rank"], e["step"])] = e["digest"]
            return last

        ours, ref = history(JOB), history(REFERENCE)
        want = {(r, s) for r in range(4) for s in range(self.steps)}
        if set(ref) != want:
            return False, f"the reference run served {len(ref)} of {len(want)} (rank, step) batches"
        if set(ours) != want:
            return False, f"missing batches: {sorted(want - set(ours))[:5]}"
        wrong = [k for k in want if ours[k] != ref[k]]
        if wrong:
            return False, f"{len(wrong)} batches differ from the failure-free run, e.g. {sorted(wrong)[:5]}"
        if len(set(ref.values())) != len(ref):
            return False, "the failure-free run served the same batch twice"
        return True, f"{len(want)} batches, each the failure-free run's, none repeated"


def durable_bound(every: int) -> int:
    """Steps a restore from the durable tier may go back: its copies are written behind the
    steps, so when every node goes at once the copy of the newest multiple of ``every`` may be
    still in flight (incomplete: not a whole step) and the one before it is restored."""
    return max(1, 2 * every - 1)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--failures", type=int, default=200)
    ap.add_argument("--steps", type=int, default=0, help="job length (default: 21 per failure + 60)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, or 'all' (adds {', '.join(EXTRA_KINDS)})")
    ap.add_argument("--data-servers", type=int, default=1, help="data servers sharing the job over etcd (coordinator_kill needs 2)")
    ap.add_argument("--rendezvous", choices=["c10d", "ffplane"], default="c10d", help="torchrun's (rendezvous_host_loss needs ffplane)")
    ap.add_argument(
        "--durable-every", type=int, default=0, help="daemons copy to a durable tier every N steps (node_and_successor needs it)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt", help="the example job (as ffplane demo --model)")
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    ap.add_argument("--out", default="soak")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs, events)")
    args = ap.parse_args(argv)
    kinds = KINDS + EXTRA_KINDS if args.kinds == "all" else tuple(k for k in args.kinds.split(",") if k)
    unknown = set(kinds) - set(KINDS + EXTRA_KINDS)
    if unknown:
        ap.error(f"unknown kinds {sorted(unknown)}; choose from {','.join(KINDS + EXTRA_KINDS)}")
    have = {"data_servers": args.data_servers >= 2, "ffplane": args.rendezvous == "ffplane", "durable": args.durable_every > 0}
    for kind in kinds:
        if kind in NEEDS and not have[NEEDS[kind][0]]:
            ap.error(f"failure kind {kind} needs {NEEDS[kind][1]}")
    # 16.7 steps per failure in a 192-failure run of all eight kinds, redundancy awaited between
    # failures; ~30 under the ffplane rendezvous (its agents rejoin at once, training goes on while
    # the soak waits); a spare_takeovers failure runs on while two spares start (~80 steps)
    takeovers = -(-args.failures * kinds.count("spare_takeovers") // max(len(kinds), 1))
    steps = args.steps or (34 if args.rendezvous == "ffplane" else 21) * args.failures + 60 + 80 * takeovers
    work = Path(tempfile.mkdtemp(prefix="ffplane-soak-"))
    soak = Soak(work, steps, args.seed, args.model)
    ok = False
    try:
        durable = ["--durable-dir", str(work / "durable"), "--durable-every", str(args.durable_every)] if args.durable_every else []
        soak.prepare(
            [REFERENCE, JOB],
            rows=max(4096, 32 * (steps + 1)),
            servers=args.data_servers,
            rendezvous=args.rendezvous,
            daemon_args=durable,
        )
        result = soak.run(args.failures, kinds)
        ok = True
    finally:
        soak.close()
        if args.keep or not ok:  # a failed soak keeps its logs, events and diagnosis
            print(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    result["config"] = {
        "failures_requested": args.failures,
        "kinds": list(kinds),
        "seed": args.seed,
        "model": args.model,
        "data_servers": args.data_servers,
        "rendezvous": args.rendezvous,
        "durable_every": args.durable_every,
        "durable_bound": durable_bound(args.durable_every),
        "nodes": 2,
        "workers_per_node": 2,
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / f"{args.out}.json"
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "records"}, indent=1))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    r = main()
    durable_ok = r["durable_fallback"]["warned"] and r["durable_fallback"]["max_lost"] <= durable_bound(r["config"]["durable_every"])
    sys.exit(
        0 if r["unrecoverable"] == 0 and r["bitwise_equal"] and r["data_exactly_once"] and r["lost_steps"]["max"] <= 1 and durable_ok else 1
    )
