"""The coordinator under many daemons: CPU per heartbeat round and time to declare a silent node dead.

    python bench/coordinator_scale.py                   # 4,096 simulated daemons x 8 workers, 3 repeats
    python bench/coordinator_scale.py --nodes 64 --rounds 2 --repeats 1   # smoke size

A simulator (this process, asyncio + aiohttp, 64 connections) sends every simulated daemon's
heartbeat once per round — node id, address, budget, 8 live workers and an inventory of 8 roles x
2 versions — spreading a round over one second. Figures: ``cpu_per_round_s`` (the data server's
user+system CPU over the measured rounds / rounds, from /proc), ``round_s`` (how long a round of
N heartbeats actually took: above 1 s the coordinator cannot keep up with 1 Hz), and
``detect_dead_s`` (from the last heartbeat of one node that then falls silent to the data server
answering ``alive: false``). Targets: ≤ 0.1 s of CPU per round, ≤ 2 s detection. The simulator
shares the 2 cores with the data server. Results: ``bench/results/coordinator_scale.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, write_results  # noqa: E402
from trainer_client.local_cluster import LocalCluster  # noqa: E402


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _body(i: int) -> dict[str, Any]:
    roles = [f"dp{i % 512 * 8 + k}-pp0-tp0" for k in range(8)]
    return {
        "node_id": f"sim{i:05d}",
        "address": f"http://10.{i // 256}.{i % 256}.1:8471",
        "budget_bytes": 64 << 30,
        "inventory": {"job": {r: [{"step": s, "checksum": "0" * 16, "nbytes": 1 << 30, "layout_roles": [r]} for s in (99, 100)] for r in roles}},
        "workers": [{"pid": 1000 + k, "job": "job", "role": r} for k, r in enumerate(roles)],
        "exited": [],
    }


class Simulator:
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


async def _measure(url: str, token: str, pid: int, nodes: int, rounds: int, repeats: int) -> dict[str, Any]:
    sim = Simulator(url, token, nodes)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
        await sim.round(session)  # everyone registers
        cpu: list[float] = []
        durations: list[float] = []
        for _ in range(repeats):
            c0 = _cpu_s(pid)
            for _ in range(rounds):
                durations.append(await sim.round(session))
            cpu.append((_cpu_s(pid) - c0) / rounds)
        detect: list[float] = []
        for k in range(repeats):
            victim = (k * 997 + 17) % nodes
            sim.silent.add(victim)
            beat = asyncio.ensure_future(_keep_beating(sim, session))
            t_last = sim.last_beat[victim]
            while True:
                async with session.get(f"{url}/v1/nodes/sim{victim:05d}") as r:
                    if not (await r.json())["alive"]:
                        detect.append(time.monotonic() - t_last)
                        break
                await asyncio.sleep(0.02)
            beat.cancel()
            sim.silent.discard(victim)
            await sim.round(session)  # it rejoins
    return {
        "cpu_per_round_s": {"min": min(cpu), "median": sorted(cpu)[len(cpu) // 2], "max": max(cpu), "samples": cpu},
        "round_s": {"min": min(durations), "median": sorted(durations)[len(durations) // 2], "max": max(durations), "samples": durations},
        "detect_dead_s": {"min": min(detect), "median": sorted(detect)[len(detect) // 2], "max": max(detect), "samples": detect},
    }


async def _keep_beating(sim: Simulator, session: aiohttp.ClientSession) -> None:
    while True:
        await sim.round(session)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=5, help="heartbeat rounds per CPU measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="coordinator_scale")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="ffplane-coord-") as tmp:
        (Path(tmp) / "data").mkdir()
        with LocalCluster(Path(tmp), Path(tmp) / "data", token) as cluster:
            ds = cluster.start_dataserver("--log-level", "warning")
            figures = asyncio.run(_measure(ds.url, token, ds.pid, args.nodes, args.rounds, args.repeats))
    checks = {
        "cpu_per_round_s": {"value": figures["cpu_per_round_s"]["median"], "ratio_to_target": figures["cpu_per_round_s"]["median"] / 0.1, "target": "<= 0.1 s"},
        "detect_dead_s": {"value": figures["detect_dead_s"]["median"], "ratio_to_target": figures["detect_dead_s"]["median"] / 2.0, "target": "<= 2 s"},
    }
    out = write_results(args.out, figures, {"nodes": args.nodes, "workers": args.nodes * 8, "rounds": args.rounds, "repeats": args.repeats}, checks, args.results_dir)
    for k, v in figures.items():
        print(f"{k:18s} min {v['min']:.3f}  median {v['median']:.3f}  max {v['max']:.3f} s")
    for k, c in checks.items():
        print(f"  {k:18s} {c['value']:.3f} s = {c['ratio_to_target']:.2f} x target ({c['target']})")
    print(f"wrote {out}")
    return {"figures": figures, "targets": checks}


if __name__ == "__main__":
    main()
