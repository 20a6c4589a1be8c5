"""Several data servers: aggregate batch throughput with 1, 2 and 4 servers, and the stall when one is killed.

    python bench/data_servers.py                          # 8 nodes, 1 Gbit/s links, 1/2/4 servers, 3 repeats (root)
    python bench/data_servers.py --seconds 2 --repeats 1  # smoke size

Network namespaces: 8 training nodes (a daemon each, one dp rank each), up to 4 data servers and 3
etcd members, every one behind its own tbf-shaped link (``--rate``). A reader thread per node
pulls batches through its daemon (``trainer_client.DataLoader``) as fast as they come; the figure
is the aggregate MB/s over ``--seconds`` after a warm-up, for 1, 2 and 4 servers (the daemons
given every server's URL), compared with the single-server figure of the same run (target: N
servers ≥ 0.8 x N x one, while the servers' links are the limit). The same sweep on unshaped
links (``--ceiling-rate``) is this machine's ceiling in the same run: where N links carry more
than it, the CPU is the limit, not the links, and the target is judged at ``--scaling-rate``
(slower links, so that N of them stay under the ceiling) as well.

The stall: readers paced at ``--paced-steps`` steps/s per node; one data server (the one that
coordinates) is SIGKILLed; a step is stalled when its batch took over ``--stall-ms`` to arrive.
Counted over the ``--after-s`` seconds after the kill, with 2 servers (target 0 stalled steps)
and, as the baseline, with one server that is restarted ``--restart-s`` later (before several
servers, only a restart brought the batches back). Results: ``bench/results/data_servers.json``.
"""

from __future__ import annotations

import argparse
import secrets
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, bar_chart, print_table, ratio, summary, write_results  # noqa: E402
from bench.replication import _rate_gbps  # noqa: E402
from ffplane_harness.etcd_cluster import EtcdCluster  # noqa: E402
from ffplane_harness.local_cluster import LocalCluster  # noqa: E402
from ffplane_harness.netns import Netns  # noqa: E402

NODES = 8
MAX_SERVERS = 4
SERVER_NODES = [0, 9, 10, 11]  # namespaces of data servers 0..3 (daemon i is in namespace i + 1)
ETCD_NODES = [12, 13, 14]


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of every CPU, from /proc/stat."""
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


class _Readers:
    """A thread per node reading its dp rank through its daemon; records (arrival time, bytes, wait)."""

    def __init__(self, cluster: LocalCluster, job: str, token: str, paced_steps: float | None = None) -> None:
        from trainer_client import DataLoader

        self.stop = threading.Event()
        self.events: list[list[tuple[float, int, float]]] = [[] for _ in range(NODES)]
        self.errors: list[str] = []
        self._threads = []
        for rank in range(NODES):
            loader = DataLoader(job, rank, token=token, socket_path=cluster.socket(rank))
            t = threading.Thread(target=self._read, args=(loader, rank, paced_steps), daemon=True)
            self._threads.append(t)
        for t in self._threads:
            t.start()

    def _read(self, loader: Any, rank: int, paced_steps: float | None) -> None:
        try:
            it = iter(loader)
            due = time.perf_counter()
            while not self.stop.is_set():
                asked = time.perf_counter()
                batch = next(it)
                got = time.perf_counter()
                self.events[rank].append((got, sum(v.numel() * v.element_size() for v in batch.values()), got - asked))
                if paced_steps:  # a training step's compute between batches
                    due += 1.0 / paced_steps
                    time.sleep(max(0.0, due - time.perf_counter()))
        except Exception as exc:  # noqa: BLE001 - reported by the benchmark
            self.errors.append(f"rank {rank}: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(timeout=30)

    def mb_per_s(self, t0: float, t1: float) -> float:
        moved = sum(n for ev in self.events for t, n, _ in ev if t0 <= t < t1)
        return moved / (t1 - t0) / 1e6


class _Bench:
    def __init__(self, work: Path, rate: str | None, token: str) -> None:
        self.work, self.token = work, token
        (work / "data").symlink_to(work.parent / "data")
        self.net = Netns(15, rate=rate)
        members = [self.net.nodes[i] for i in ETCD_NODES]
        self.etcd = EtcdCluster(work, [m.addr for m in members], [m.exec_argv for m in members]).start()
        self.runs = 0

    def cluster(self, servers: int, etcd: bool = True) -> LocalCluster:
        c = LocalCluster(self.work, self.work / "data", self.token, net=self.net)
        for i in range(servers):
            c.start_dataserver(*(["--etcd", self.etcd.endpoints] if etcd else []), index=i, node=SERVER_NODES[i])
        c.leader()
        for _ in range(NODES):
            c.start_daemon("--window", "8", budget_mb=512)
        return c

    def job(self, c: LocalCluster) -> str:
        self.runs += 1
        name = f"run{self.runs}"
        body = {"name": name, "dataset": "big", "dp": NODES, "batch_per_rank": 32, "seed": self.runs}
        r = httpx.post(c.leader().url + "/v1/jobs", json=body, headers={"Authorization": f"Bearer {self.token}"}, timeout=30)
        r.raise_for_status()
        return name

    def throughput(self, servers: int, seconds: float, repeats: int, etcd: bool = True) -> dict[str, Any]:
        """Aggregate MB/s (min/median/max), with ``cpu_busy``: the share of both cores busy meanwhile."""
        samples, busy = [], []
        with self.cluster(servers, etcd) as c:
            for _ in range(repeats):
                readers = _Readers(c, self.job(c), self.token)
                time.sleep(1.0)  # warm-up: windows filled, connections open
                t0, cpu0 = time.perf_counter(), _cpu_ticks()
                time.sleep(seconds)
                t1, cpu1 = time.perf_counter(), _cpu_ticks()
                readers.close()
                if readers.errors:
                    raise RuntimeError(f"readers failed: {readers.errors}")
                samples.append(readers.mb_per_s(t0, t1))
                busy.append((cpu1[0] - cpu0[0]) / max(1, cpu1[1] - cpu0[1]))
        return {**summary(samples), "cpu_busy": summary(busy)}

    def stall(self, servers: int, paced: float, after_s: float, stall_ms: float, restart_s: float | None) -> dict[str, Any]:
        with self.cluster(servers) as c:
            readers = _Readers(c, self.job(c), self.token, paced_steps=paced)
            time.sleep(2.0)
            victim = c.leader()
            index = c.dataservers.index(victim)
            port = int(victim.ready["port"])  # type: ignore[call-overload]
            killed = time.perf_counter()
            victim.kill(signal.SIGKILL)
            if restart_s is not None:
                time.sleep(restart_s)
                c.start_dataserver("--etcd", self.etcd.endpoints, port=port, index=index, node=SERVER_NODES[index])
            time.sleep(max(0.0, killed + after_s - time.perf_counter()))
            readers.close()
            taken = c.leader(timeout_s=10).url if servers > 1 else None
        waits = [w for ev in readers.events for t, _, w in ev if killed <= t < killed + after_s]
        return {
            "stalled_steps": sum(1 for w in waits if w > stall_ms / 1000),
            "stall_s": sum(max(0.0, w - stall_ms / 1000) for w in waits),
            "max_wait_s": max(waits, default=0.0),
            "steps": len(waits),
            "errors": readers.errors,
            "coordinating_after": taken,
        }

    def close(self) -> None:
        self.etcd.close()
        self.net.close()


def _dataset(work: Path, rows: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dataserver.ingest import IngestConfig, ingest

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, size=(rows, 8192), dtype=np.int32)  # 32 KiB a sample, 1 MiB a rank's step
    pq.write_table(pa.table({"tokens": pa.array(list(tokens))}), work / "big.parquet")
    (work / "data").mkdir()
    ingest(IngestConfig([work / "big.parquet"], work / "data" / "big", progress=False))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", default="1gbit", help="every link's rate (servers', nodes', etcd's)")
    ap.add_argument("--ceiling-rate", default="none", help="the same sweep on links this fast (none: unshaped): the machine's ceiling")
    ap.add_argument("--scaling-rate", default="300mbit", help="slower links, judged too when N x --rate exceeds the ceiling")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--paced-steps", type=float, default=5.0, help="steps/s per node while one server is killed")
    ap.add_argument("--stall-ms", type=float, default=100.0, help="a batch that took longer than this stalled its step")
    ap.add_argument("--after-s", type=float, default=8.0)
    ap.add_argument("--restart-s", type=float, default=2.0, help="the baseline's single server comes back after this")
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    token = secrets.token_hex(16)
    work = Path(tempfile.mkdtemp(prefix="ffplane-bench-ds-"))
    _dataset(work, args.rows)
    figures: dict[str, Any] = {}
    stalls: dict[str, Any] = {}
    counts = [1, 2, MAX_SERVERS]
    for label, rate in (("", args.rate), ("ceiling_", args.ceiling_rate), ("scaling_", args.scaling_rate)):
        (work / (label or "links")).mkdir(exist_ok=True)
        bench = _Bench(work / (label or "links"), None if rate == "none" else rate, token)
        try:
            for n in counts:
                figures[f"{label}servers_{n}_mb_s"] = bench.throughput(n, args.seconds, args.repeats)
                print(f"{rate}: {n} data server(s): {figures[f'{label}servers_{n}_mb_s']['median']:.1f} MB/s", flush=True)
            if not label:  # what job records in etcd cost a lone server (a transaction per batch request)
                figures["servers_1_no_etcd_mb_s"] = bench.throughput(1, args.seconds, args.repeats, etcd=False)
                stalls["two_servers_one_killed"] = bench.stall(2, args.paced_steps, args.after_s, args.stall_ms, None)
                stalls["one_server_killed_restarted"] = bench.stall(1, args.paced_steps, args.after_s, args.stall_ms, args.restart_s)
        finally:
            bench.close()

    link_mb_s = _rate_gbps(args.rate) * 1e3
    checks: dict[str, Any] = {}
    for label, rate in (("", args.rate), ("scaling_", args.scaling_rate)):
        one = figures[f"{label}servers_1_mb_s"]
        for n in counts[1:]:
            need = n * _rate_gbps(rate) * 1e3
            # the links are the limit when this machine moves more than N links carry (unshaped, same
            # run) and the N-server run left the CPUs some room
            fig = figures[f"{label}servers_{n}_mb_s"]
            link_bound = need <= 0.9 * figures[f"ceiling_servers_{n}_mb_s"]["median"] and fig["cpu_busy"]["median"] < 0.9
            checks[f"{label}servers_{n}_vs_one"] = {
                "ratio": ratio(figures[f"{label}servers_{n}_mb_s"], one),
                "target": f">= {0.8 * n:.1f}" + ("" if link_bound else " (not judged: the CPUs, not the links, are the limit here)"),
                "cpu_busy": fig["cpu_busy"]["median"],
                "link_utilisation": fig["median"] / need,  # of the N servers' links' line rate
                "links_are_the_limit": link_bound,
            }
    checks["one_server_etcd_vs_none"] = {
        "ratio": ratio(figures["servers_1_mb_s"], figures["servers_1_no_etcd_mb_s"]),
        "target": "(cost of shared records)",
    }
    checks["stalled_steps_two_servers_one_killed"] = {"value": stalls["two_servers_one_killed"]["stalled_steps"], "target": "0"}
    checks["stalled_steps_one_server_restarted"] = {"value": stalls["one_server_killed_restarted"]["stalled_steps"], "target": "(baseline)"}

    rows = [(f"{args.rate}: 1 server, no etcd", figures["servers_1_no_etcd_mb_s"], "")]
    for label, rate in (("", args.rate), ("scaling_", args.scaling_rate), ("ceiling_", args.ceiling_rate)):
        one = figures[f"{label}servers_1_mb_s"]
        rows.append((f"{rate}: 1 server (baseline)", one, ""))
        for n in counts[1:]:
            fig = figures[f"{label}servers_{n}_mb_s"]
            rows.append((f"{rate}: {n} servers", fig, f"{ratio(fig, one):.2f}x one, CPUs {fig['cpu_busy']['median']:.0%} busy"))
    print_table(rows, "MB/s")
    for name, s in stalls.items():
        print(f"{name}: {s['stalled_steps']} stalled steps of {s['steps']} (> {args.stall_ms:.0f} ms), max wait {s['max_wait_s']:.2f} s")
    figures["stall"] = stalls
    config = {k: v for k, v in vars(args).items() if k != "results_dir"} | {"nodes": NODES, "link_mb_s": link_mb_s}
    out = write_results("data_servers", figures, config, checks, args.results_dir)
    bar_chart(
        args.results_dir / "data_servers.png",
        [(name, fig) for name, fig, _ in rows],
        "aggregate MB/s",
        f"{NODES} nodes reading through their daemons, 1/2/4 data servers",
    )
    print(f"results: {out}")
    return {"figures": figures, "targets": checks}


if __name__ == "__main__":
    main()
