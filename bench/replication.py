"""Replication and remote-restore throughput between node namespaces, against the link and raw TCP.

    python bench/replication.py                        # 1 Gbit/s links, 256 MiB shard, 3 repeats (root)
    python bench/replication.py --rate 4gbit --mb 512
    python bench/replication.py --mb 8 --repeats 1     # smoke size

Four namespaces on a tbf-shaped bridge (see ffplane_harness/netns.py): the data server, and node
daemons A → B → C in a ring. Figures, each repeated:
``raw_tcp_gbps`` — one message of the shard's size from A's namespace to B's over a plain socket
(the baseline); ``replication_gbps`` — a role saves on A, from the commit to B holding the
verified replica; ``remote_restore_gbps`` — C, holding nothing, answers a restore of that role by
pulling the shard from A or B (the daemon's whole ``restorable`` request). Target: both ≥ 0.7 x
raw TCP. Results: ``bench/results/replication.json``.
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, print_table, ratio, repeat, write_results  # noqa: E402
from ffplane_harness.local_cluster import LocalCluster  # noqa: E402
from ffplane_harness.netns import Netns  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _rate_gbps(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale / 8 / 1e9
    raise SystemExit(f"rate {rate!r}: use e.g. 1gbit or 500mbit")


def _traffic(net: Netns, node: int, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        net.nodes[node].exec_argv([sys.executable, "-m", "bench._traffic", *args]), cwd=REPO, stdout=subprocess.PIPE, text=True
    )


def raw_tcp_gbps(net: Netns, src: int, dst: int, mb: float, port: int = 5201) -> float:
    sink = _traffic(net, dst, "sink", str(port))
    try:
        assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
        sender = _traffic(net, src, "stream", net.nodes[dst].addr, str(port), str(mb))
        out, _ = sender.communicate(timeout=300)
        result = json.loads(out)
        return float(result["bytes"]) / result["seconds"] / 1e9
    finally:
        sink.kill()
        sink.wait()


def _state(c: LocalCluster, i: int) -> dict[str, Any]:
    return httpx.get(c.daemons[i].url + "/v1/state", timeout=10).json()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", default="1gbit", help="tc rate of every node's link")
    ap.add_argument("--mb", type=float, default=256, help="shard size")
    ap.add_argument("--chunk-kb", type=int, default=1024, help="the daemons' STATE chunk")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    ap.add_argument("--out", default="replication")
    args = ap.parse_args(argv)

    import torch

    from ffplane_contract.control import Restorable
    from trainer_client import Checkpointer
    from trainer_client._daemon_client import DaemonClient

    token = secrets.token_hex(16)
    work = Path(tempfile.mkdtemp(prefix="ffplane-bench-repl-"))
    (work / "data").mkdir()
    figures: dict[str, Any] = {}
    with Netns(4, rate=args.rate) as net, LocalCluster(work, work / "data", token, net=net) as c:
        c.start_dataserver()
        budget = int(args.mb * 8) + 256
        for _ in range(3):
            c.start_daemon("--gate-chunk-kb", str(args.chunk_kb), budget_mb=budget)
        assert c.dataserver is not None
        for i, successor in enumerate(("n1", "n2", "n0")):  # the three in one ring, each knowing it
            c.until_successor(i, successor)

        figures["raw_tcp_gbps"] = repeat(lambda: raw_tcp_gbps(net, 1, 2, args.mb), args.repeats)

        ck = Checkpointer("bench", socket_path=c.socket(0))
        state = {"w": torch.zeros(int(args.mb * 2**20) // 4)}
        steps = iter(range(1, 10_000))
        last: dict[str, int] = {}

        def replication() -> float:
            step = next(steps)
            state["w"][0] = step
            ck.save(step, state)
            ck.wait()
            committed = time.perf_counter()
            while (_state(c, 0)["replication"]["roles"].get("bench/dp0-pp0-tp0") or {}).get("replicated") != step:
                time.sleep(0.002)
            last["step"] = step
            return args.mb * 2**20 / (time.perf_counter() - committed) / 1e9

        def remote_restore() -> float:
            replication()  # a step C has never seen
            step = last["step"]
            while (
                len(
                    httpx.get(f"{c.dataservers[0].url}/v1/jobs/bench/status")
                    .json()["shard_locations"]
                    .get("dp0-pp0-tp0", {})
                    .get(str(step), [])
                )
                < 2
            ):
                time.sleep(0.01)  # the coordinator has heard of both copies
            client = DaemonClient(c.socket(2), 300)
            try:
                started = time.perf_counter()
                reply = client.call(Restorable("bench", verify=False, roles=["dp0-pp0-tp0"]))
                seconds = time.perf_counter() - started
            finally:
                client.close()
            assert reply.step == step and reply.shards["dp0-pp0-tp0"]["kind"] == "pulled", reply
            return args.mb * 2**20 / seconds / 1e9

        figures["replication_gbps"] = repeat(replication, args.repeats)
        figures["remote_restore_gbps"] = repeat(remote_restore, args.repeats)
        ck.close()

    link = _rate_gbps(args.rate)
    checks = {
        "replication_vs_raw_tcp": {"ratio": ratio(figures["replication_gbps"], figures["raw_tcp_gbps"]), "target": ">= 0.7"},
        "remote_restore_vs_raw_tcp": {"ratio": ratio(figures["remote_restore_gbps"], figures["raw_tcp_gbps"]), "target": ">= 0.7"},
        "replication_vs_link": {"ratio": figures["replication_gbps"]["median"] / link, "target": "(information)"},
        "remote_restore_vs_link": {"ratio": figures["remote_restore_gbps"]["median"] / link, "target": "(information)"},
    }
    print_table(
        [
            ("raw_tcp_gbps (baseline)", figures["raw_tcp_gbps"], f"link {link:.3f} GB/s"),
            ("replication_gbps", figures["replication_gbps"], f"{checks['replication_vs_raw_tcp']['ratio']:.2f}x raw TCP"),
            ("remote_restore_gbps", figures["remote_restore_gbps"], f"{checks['remote_restore_vs_raw_tcp']['ratio']:.2f}x raw TCP"),
        ],
        "GB/s",
    )
    config = {"rate": args.rate, "link_gbps": link, "shard_mb": args.mb, "chunk_kb": args.chunk_kb, "repeats": args.repeats}
    path = write_results(args.out, figures, config, checks, args.results_dir)
    print(f"wrote {path}")
    return {"figures": figures, "targets": checks}


if __name__ == "__main__":
    main()
