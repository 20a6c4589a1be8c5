"""The coordinator under many daemons: CPU per heartbeat round and time to declare a silent node dead.

    python bench/coordinator_scale.py                   # 4,096 simulated daemons x 8 workers, 3 repeats
    python bench/coordinator_scale.py --nodes 64 --rounds 2 --repeats 1   # smoke size

A simulator (this process, asyncio) plays every daemon: each simulated node registers with a full
HTTP heartbeat — node id, address, budget, 8 live workers and an inventory of 8 roles x 2
versions — then beats once per round, the rounds' beats spread over one second. Three transports
are measured in the same run, each against a fresh data server:

* ``udp`` (the headline figures): the daemons' transport — authenticated UDP datagrams, a node's
  inventory riding along only when it changed. Modelled change rate: each node commits a step
  every ``--commit-s`` seconds (default 5: one beat in five carries an inventory);
* ``udp_worst``: the same, every beat of every node carrying a changed inventory (a committed
  step every second on every node);
* ``http``: the full JSON heartbeat POSTed every second (the only transport before UDP beats;
  still served, for registration and compatibility) — the baseline.

Figures: ``cpu_per_round_s`` (the data server's CPU over the measured rounds / rounds, from
``/proc/<pid>/task/*/schedstat``), ``round_s`` (from a round's start until the last answer of its
beats: above 1 s the coordinator cannot keep up with 1 Hz), ``detect_dead_s`` (from the last answered beat of one node
that then falls silent to the data server answering ``alive: false``; the others keep beating),
``register_cpu_s`` (CPU of the start: 1,024 nodes a second registering, then fetching the ring
view once). Targets: <= 0.1 s of CPU per round, <= 2 s detection. The simulator shares the 2
cores with the data server. Results: ``bench/results/coordinator_scale.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, cpu_s, write_results  # noqa: E402
from ffplane_contract import heartbeat as co  # noqa: E402
from ffplane_harness.local_cluster import LocalCluster  # noqa: E402

MODES = ("udp", "udp_worst", "http")


async def _until_dead(session: aiohttp.ClientSession, url: str, victim: int, t_last: float) -> float:
    """Seconds from the silent node's last heartbeat to the data server calling it dead."""
    while True:
        async with session.get(f"{url}/v1/nodes/sim{victim:05d}") as r:
            if not (await r.json())["alive"]:
                return time.monotonic() - t_last
        await asyncio.sleep(0.02)


def _body(i: int, step: int = 100) -> dict[str, Any]:
    roles = [f"dp{i % 512 * 8 + k}-pp0-tp0" for k in range(8)]
    return {
        "node_id": f"sim{i:05d}",
        "address": f"http://10.{i // 256}.{i % 256}.1:8471",
        "budget_bytes": 64 << 30,
        "inventory": {
            "job": {
                r: [{"step": s, "checksum": secrets.token_hex(8), "nbytes": 1 << 30, "layout_roles": [r]} for s in (step - 1, step)]
                for r in roles
            }
        },
        "workers": [{"pid": 1000 + k, "job": "job", "role": r} for k, r in enumerate(roles)],
        "exited": [],
    }


def _summary(xs: list[float]) -> dict[str, Any]:
    return {"min": min(xs), "median": sorted(xs)[len(xs) // 2], "max": max(xs), "samples": xs}


class Simulator:
    """The HTTP baseline: every beat is the full JSON heartbeat."""

    def __init__(self, url: str, token: str, nodes: int) -> None:
        self.url, self.nodes = url, nodes
        self.headers = {"Authorization": f"Bearer {token}"}
        self.bodies = [_body(i) for i in range(nodes)]
        self.silent: set[int] = set()
        self.last_beat: dict[int, float] = {}

    async def round(self, session: aiohttp.ClientSession, period_s: float = 1.0) -> float:
        """One heartbeat from every live simulated node, spread over ``period_s``; its duration."""
        started = time.monotonic()
        sem = asyncio.Semaphore(64)

        async def one(i: int) -> None:
            await asyncio.sleep(period_s * i / self.nodes)
            if i in self.silent:
                return
            async with sem:
                async with session.post(self.url + "/v1/nodes/heartbeat", json=self.bodies[i], headers=self.headers) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"heartbeat answered {r.status}")
                self.last_beat[i] = time.monotonic()

        await asyncio.gather(*(one(i) for i in range(self.nodes)))
        return time.monotonic() - started


async def _measure_http(url: str, token: str, pid: int, nodes: int, rounds: int, repeats: int) -> dict[str, Any]:
    sim = Simulator(url, token, nodes)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
        c0 = cpu_s(pid)
        await sim.round(session)  # everyone registers
        await sim.round(session)
        register_cpu = cpu_s(pid) - c0
        cpu: list[float] = []
        durations: list[float] = []
        for _ in range(repeats):
            c0 = cpu_s(pid)
            for _ in range(rounds):
                durations.append(await sim.round(session))
            cpu.append((cpu_s(pid) - c0) / rounds)
        detect: list[float] = []
        for k in range(repeats):
            victim = (k * 997 + 17) % nodes
            sim.silent.add(victim)
            beat = asyncio.ensure_future(_keep_beating(sim, session))
            detect.append(await _until_dead(session, url, victim, sim.last_beat[victim]))
            beat.cancel()
            sim.silent.discard(victim)
            await sim.round(session)  # it rejoins
    return {
        "cpu_per_round_s": _summary(cpu),
        "round_s": _summary(durations),
        "detect_dead_s": _summary(detect),
        "register_cpu_s": register_cpu,
    }


async def _keep_beating(sim: Simulator, session: aiohttp.ClientSession) -> None:
    while True:
        await sim.round(session)


def _epoch_version(view: bytes) -> tuple[int, int]:
    """The view's epoch and version: the simulator reads the head of the 4,096 members' view
    (a daemon parses it all, on its own core, once per join storm)."""
    m = re.match(rb'\{"epoch":(\d+),"version":(\d+),', view)
    if m is None:
        raise RuntimeError(f"unexpected view {view[:100]!r}")
    return int(m[1]), int(m[2])


class _Answers(asyncio.DatagramProtocol):
    def __init__(self, sim: UdpSimulator) -> None:
        self.sim = sim

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.sim.answered(data)


class UdpSimulator:
    """Every simulated daemon speaking the daemons' UDP transport, from one socket."""

    def __init__(self, url: str, token: str, pid: int, nodes: int, commit_rounds: int) -> None:
        self.url, self.nodes, self.commit_rounds = url, nodes, commit_rounds
        self.key = token.encode()
        self.headers = {"Authorization": f"Bearer {token}"}
        self.bodies = [_body(i) for i in range(nodes)]
        # two inventories per node, alternated: a commit changes it
        self.payloads = [
            [co.encode_inventory(_body(i, step)["inventory"], self.bodies[i]["workers"]) for step in (100, 101)] for i in range(nodes)
        ]
        self.sessions = [os.urandom(8) for _ in range(nodes)]
        self.inv = [0] * nodes  # the inventory variant the coordinator holds
        self.inv_version = [0] * nodes
        self.views = [(0, 0)] * nodes  # (epoch, version) each node holds
        self.full_view_after = [0.0] * nodes
        self.counter = 0
        self.pending: dict[int, tuple[int, int, int]] = {}  # counter → (node, kind, variant)
        self.silent: set[int] = set()
        self.last_beat: dict[int, float] = {}
        self.lost = self.inventories = self.full_views = self.registrations = self.register_failures = 0
        self.round_no = 0
        self.registered: set[int] = set()
        self.admitted = nodes  # nodes started so far
        self.registering: set[int] = set()
        self.http_slots = asyncio.Semaphore(64)  # like the HTTP baseline's connection limit
        self.tasks: set[asyncio.Task[None]] = set()
        self.drained = asyncio.Event()
        self.transport: asyncio.DatagramTransport | None = None
        self.addr: Any = None
        self.session: aiohttp.ClientSession | None = None

    async def start(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        async with session.get(self.url + "/v1/nodes") as r:
            port = (await r.json())["udp_port"]
        host = self.url.split("//")[1].rsplit(":", 1)[0]
        self.addr = (host, port)
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(lambda: _Answers(self), family=socket.AF_INET)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)

    async def register(self, i: int) -> None:
        """A full HTTP heartbeat (a daemon's first, or after "unknown node")."""
        assert self.session is not None
        self.registering.add(i)
        self.registered.discard(i)
        self.counter += 1
        body = {**self.bodies[i], "udp": {"session": self.sessions[i].hex(), "counter": self.counter, "inv_version": self.counter}}
        try:
            async with self.http_slots, self.session.post(self.url + "/v1/nodes/heartbeat", json=body, headers=self.headers) as r:
                if r.status != 200:
                    raise RuntimeError(f"heartbeat answered {r.status}")
                view = await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            self.register_failures += 1  # tried again in the next round
            return
        finally:
            self.registering.discard(i)
        self.inv[i], self.inv_version[i] = 0, body["udp"]["inv_version"]
        self.views[i] = _epoch_version(view)
        self.last_beat[i] = time.monotonic()
        self.registrations += 1
        self.registered.add(i)

    async def full_view(self, i: int) -> None:
        assert self.session is not None
        try:
            async with self.http_slots, self.session.get(self.url + "/v1/nodes/view", params={"node_id": f"sim{i:05d}"}) as r:
                self.views[i] = _epoch_version(await r.read())
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return
        self.full_views += 1

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def answered(self, data: bytes) -> None:
        a = co.Answer.decode(self.key, data)
        if a is None:
            return
        status, view, counter, epoch, version, events = a.status, a.view, a.counter, a.epoch, a.version, a.events
        sent = self.pending.pop(counter, None)
        if sent is None:
            return
        i, kind, variant = sent
        if status == co.STATUS_UNKNOWN:
            if i not in self.registering:
                self._spawn(self.register(i))
        else:
            self.last_beat[i] = time.monotonic()
            if kind == co.KIND_INV and status == co.STATUS_OK:
                self.inv[i], self.inv_version[i] = variant, counter
            if view == co.VIEW_EVENTS:
                json.loads(events)  # a daemon applies them
                self.views[i] = (epoch, version)
            elif view == co.VIEW_FULL and time.monotonic() >= self.full_view_after[i]:
                self.full_view_after[i] = time.monotonic() + 5.0  # as daemons do
                self._spawn(self.full_view(i))
        if not self.pending:
            self.drained.set()

    def beat(self, i: int, worst: bool) -> None:
        assert self.transport is not None
        self.counter += 1
        variant = self.inv[i]
        if worst or (self.round_no + i) % self.commit_rounds == 0:
            variant = 1 - variant  # this node committed a step since its last beat
        kind = co.KIND_INV if variant != self.inv[i] else co.KIND_BEAT
        epoch, version = self.views[i]
        inv = self.counter if kind == co.KIND_INV else self.inv_version[i]
        payload = self.payloads[i][variant] if kind == co.KIND_INV else b""
        self.inventories += kind == co.KIND_INV
        self.pending[self.counter] = (i, kind, variant)
        self.transport.sendto(
            co.Beat(kind, f"sim{i:05d}", self.sessions[i], self.counter, inv, epoch, version, payload).encode(self.key), self.addr
        )

    async def round(self, worst: bool = False, period_s: float = 1.0, slice_s: float = 0.005) -> float:
        """One beat from every live simulated node, spread over ``period_s``; the time until the
        last answer (beats unanswered after 3 s count as lost)."""
        started = time.monotonic()
        self.round_no += 1
        done = 0
        while done < self.nodes:
            due = min(self.nodes, int(self.nodes * (time.monotonic() - started + slice_s) / period_s) + 1)
            for i in range(done, due):
                if i in self.silent or i in self.registering or i >= self.admitted:
                    continue
                if i in self.registered:
                    self.beat(i, worst)
                else:
                    self._spawn(self.register(i))
            done = due
            await asyncio.sleep(slice_s)
        self.drained.clear()
        if self.pending:
            try:
                await asyncio.wait_for(self.drained.wait(), 3.0)
            except asyncio.TimeoutError:
                self.lost += len(self.pending)
                self.pending.clear()
        return time.monotonic() - started

    async def settle(self) -> None:
        """Wait for the registrations and view fetches under way."""
        while self.tasks:
            await asyncio.gather(*list(self.tasks))


async def _measure_udp(
    url: str, token: str, pid: int, nodes: int, rounds: int, repeats: int, worst: bool, commit_rounds: int
) -> dict[str, Any]:
    sim = UdpSimulator(url, token, pid, nodes, commit_rounds)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
        await sim.start(session)
        c0 = cpu_s(pid)
        # daemons start over a few seconds (1,024 a second here), register over HTTP, fetch the view
        for k in range(1, -(-nodes // 1024) + 1):
            sim.admitted = min(nodes, k * 1024)
            await sim.round(worst)
        await sim.round(worst)
        register_cpu = cpu_s(pid) - c0
        await sim.settle()
        # a storm of 4,096 registrations overloads 2 cores for a few seconds (decisions.md):
        # measure once every node beats over UDP with the current view
        warmup = 0
        for warmup in range(1, 21):
            before = (sim.registrations, sim.full_views)
            await sim.round(worst)
            await sim.settle()
            if warmup > 6 and (sim.registrations, sim.full_views) == before:  # > the daemons' 5 s between whole views
                break
        cpu: list[float] = []
        durations: list[float] = []
        inventories = sim.inventories
        for _ in range(repeats):
            c0 = cpu_s(pid)
            for _ in range(rounds):
                durations.append(await sim.round(worst))
            cpu.append((cpu_s(pid) - c0) / rounds)
        inventory_share = (sim.inventories - inventories) / (rounds * repeats * nodes)
        detect: list[float] = []
        for k in range(repeats):
            victim = (k * 997 + 17) % nodes
            sim.silent.add(victim)
            stop = asyncio.Event()

            async def keep_beating() -> None:
                while not stop.is_set():
                    await sim.round(worst)

            beat = asyncio.ensure_future(keep_beating())
            detect.append(await _until_dead(session, url, victim, sim.last_beat[victim]))
            stop.set()
            await beat
            sim.silent.discard(victim)
            await sim.round(worst)  # it rejoins (unknown → full heartbeat), the others get the events
        await sim.settle()
    return {
        "cpu_per_round_s": _summary(cpu),
        "round_s": _summary(durations),
        "detect_dead_s": _summary(detect),
        "register_cpu_s": register_cpu,
        "beats_with_inventory": inventory_share,
        "lost_beats": sim.lost,
        "full_view_fetches": sim.full_views,
        "registrations": sim.registrations,
        "failed_registrations": sim.register_failures,
        "warmup_rounds": warmup,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=5, help="heartbeat rounds per CPU measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--commit-s", type=int, default=5, help="udp mode: seconds between a node's committed steps (inventory changes)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--out", default="coordinator_scale")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        p.error(f"--modes: choose from {','.join(MODES)}")
    token = secrets.token_hex(16)
    by_mode: dict[str, dict[str, Any]] = {}
    for mode in modes:
        with tempfile.TemporaryDirectory(prefix="ffplane-coord-") as tmp:
            (Path(tmp) / "data").mkdir()
            with LocalCluster(Path(tmp), Path(tmp) / "data", token) as cluster:
                ds = cluster.start_dataserver("--log-level", "warning")
                if mode == "http":
                    run = _measure_http(ds.url, token, ds.pid, args.nodes, args.rounds, args.repeats)
                else:
                    run = _measure_udp(ds.url, token, ds.pid, args.nodes, args.rounds, args.repeats, mode == "udp_worst", args.commit_s)
                by_mode[mode] = asyncio.run(run)
        f = by_mode[mode]
        print(
            f"{mode}: "
            + "  ".join(f"{k} {f[k]['median']:.3f}" for k in ("cpu_per_round_s", "round_s", "detect_dead_s"))
            + f"  register_cpu_s {f['register_cpu_s']:.2f}"
        )
    head = modes[0]
    figures: dict[str, Any] = {**by_mode[head], "transport": head}
    for mode in modes[1:]:
        figures[mode] = by_mode[mode]
    if "http" in by_mode and head != "http":
        figures["http_over_" + head] = {
            k: by_mode["http"][k]["median"] / by_mode[head][k]["median"] for k in ("cpu_per_round_s", "round_s", "detect_dead_s")
        }
    checks = {
        "cpu_per_round_s": {
            "value": figures["cpu_per_round_s"]["median"],
            "ratio_to_target": figures["cpu_per_round_s"]["median"] / 0.1,
            "target": "<= 0.1 s",
        },
        "detect_dead_s": {
            "value": figures["detect_dead_s"]["median"],
            "ratio_to_target": figures["detect_dead_s"]["median"] / 2.0,
            "target": "<= 2 s",
        },
    }
    config = {
        "nodes": args.nodes,
        "workers": args.nodes * 8,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "modes": modes,
        "commit_s": args.commit_s,
    }
    out = write_results(args.out, figures, config, checks, args.results_dir)
    for mode in modes:
        print(f"-- {mode}")
        for k in ("cpu_per_round_s", "round_s", "detect_dead_s"):
            v = by_mode[mode][k]
            print(f"  {k:18s} min {v['min']:.3f}  median {v['median']:.3f}  max {v['max']:.3f} s")
    for k, c in checks.items():
        print(f"  {k:18s} {c['value']:.3f} s = {c['ratio_to_target']:.2f} x target ({c['target']}, {head})")
    print(f"wrote {out}")
    return {"figures": figures, "targets": checks}


if __name__ == "__main__":
    main()
