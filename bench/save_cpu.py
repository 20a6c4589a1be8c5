"""The CPU one ``Checkpointer.save`` costs the machine — the save, its commit, the push to the ring
successor and the receive there — by process, against its floor measured in the same run.

    python bench/save_cpu.py                          # 4 MiB (600 saves), FSDP2 (100), 256 MiB and 1 GiB per role, 3 repeats (~3 min)
    python bench/save_cpu.py --cases cnn --saves 20 --repeats 1   # smoke size
    python bench/save_cpu.py --transport http         # the pushes over HTTP (a daemon with --bulk-port -1)

Two daemons in a ring (node 0 pushes every commit to node 1); one worker (this process) saves on
node 0. Cases:

* ``cnn`` — ``overhead.Loop("cnn")``'s model + AdamW state (4 MiB), ``--saves`` saves with
  ``--gap-ms`` of busy-looping between them (a training thread computes between saves; one
  blocked on the daemon's socket instead would make each reply cost a wake-up). Per save, CPU
  ms by thread: ``save_ms`` (the training thread in ``save()`` and a young collection after it),
  ``worker_other_ms`` (the worker's other Python threads), ``sender_ms`` (node 0's daemon: commit and push),
  ``receiver_ms`` (node 1's daemon); ``total_ms`` their sum. torch's intra-op threads are
  reported apart (``torch_threads_ms``) and not in the total: they spin-wait after every
  parallel region, which /proc cannot tell apart from work.
* ``fsdp2`` — the same figures for an FSDP2 state of 1,200 tensors (900 DTensors, 7.6 MiB; see
  ``_Fsdp2State``), ``--fsdp2-saves`` saves: what a save costs per tensor.
* ``256``, ``1024`` — a state of that many MiB (eight float32 tensors); each save waits for its
  commit, whose answer waits for the replica. CPU seconds per GiB by process, every thread:
  ``worker_s_per_gib``, ``sender_s_per_gib``, ``receiver_s_per_gib``, ``total_s_per_gib``.

The floor, per case, in the same run: one copy of the same bytes into pre-faulted memory, one
XXH3 of them, and a bare loopback TCP transfer of them (``sendfile`` from a tmpfs file into a
pre-faulted buffer, both ends' CPU) — what a replicated save cannot avoid; the per-save cases' right
after each repeat of their saves and over as many transfers. Beside it, for the large
cases, the receiving end alone into a tmpfs file made afresh (``receive_fresh_file``) and into one
whose pages exist (``receive_reused_file``): why a replica's file is reused. Targets: ≤ 1.5x the
floor at 1 GiB, ≤ 2x at 4 MiB. Results: ``bench/results/save_cpu.json``.
"""

from __future__ import annotations

import argparse
import gc
import mmap
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, cpu_by_thread, cpu_s, print_table, ratio, summary, write_results  # noqa: E402
from bench.overhead import Loop  # noqa: E402
from ffplane_contract import control as proto  # noqa: E402
from ffplane_contract.checksum import checksum  # noqa: E402
from ffplane_harness.local_cluster import LocalCluster  # noqa: E402
from ffplane_runtime.pagemap import populate_write  # noqa: E402
from trainer_client import Checkpointer  # noqa: E402
from trainer_client._daemon_client import DaemonClient  # noqa: E402
from trainer_client.state_codec import encode  # noqa: E402

GIB = 1 << 30
WARM_SAVES = 4  # slots allocated and faulted, and the receiver's replica files reused from then on


# --- the floor -----------------------------------------------------------------------------
def _copy_hash_s(nbytes: int, times: int) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.fill_(1)  # pre-faulted, as a slot is
    t0 = time.thread_time()
    for _ in range(times):
        dst.copy_(src)
        checksum(dst.numpy().data)
    return (time.thread_time() - t0) / times


def _tcp_s(nbytes: int, times: int, where: Path, into: str = "buffer") -> tuple[float, float]:
    """CPU seconds (sender, receiver) of a loopback TCP connection moving ``nbytes``: sendfile
    from a tmpfs file into ``into``: a pre-faulted buffer (the floor), a tmpfs file made afresh
    for each transfer and mapped (``fresh``: what a receiver pays that allocates each replica's
    file), or one such file mapped once and written again (``reused``: a spare)."""
    src = where / "floor.bin"
    with open(src, "wb") as f:
        f.truncate(nbytes)
        f.write(os.urandom(min(nbytes, 1 << 20)) * (nbytes // min(nbytes, 1 << 20)))
    keep: list[Any] = []

    def target(k: int) -> memoryview:
        if into == "buffer" or (into == "reused" and keep):
            if not keep:
                keep.append(bytearray(b"\1" * nbytes))
            return memoryview(keep[-1])
        path = where / f"recv-{k}.bin"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
        os.close(fd)
        path.unlink()  # the mapping keeps the pages until it goes
        populate_write(mm)  # as the daemon's receiver does
        keep[:] = [mm]
        return memoryview(mm)

    srv = socket.create_server(("127.0.0.1", 0))
    rx_cpu = [0.0]

    def receive(conn: socket.socket) -> None:
        for k in range(times + (into == "reused")):  # a reused file's first fill is not counted
            if into == "fresh":  # making and mapping the file is what is measured
                t0 = time.thread_time()
                view = target(k)
            else:  # the buffer, or the spare, is there before the bytes come
                view = target(k)
                t0 = time.thread_time()
            got = 0
            while got < nbytes:
                got += conn.recv_into(view[got:], nbytes - got)
            view.release()
            if k or into != "reused":
                rx_cpu[0] += time.thread_time() - t0

    out = socket.create_connection(srv.getsockname())
    conn, _ = srv.accept()
    th = threading.Thread(target=receive, args=(conn,))
    th.start()
    fd = os.open(src, os.O_RDONLY)
    tx = 0.0
    for k in range(times + (into == "reused")):
        t0 = time.thread_time()
        pos = 0
        while pos < nbytes:
            pos += os.sendfile(out.fileno(), fd, pos, nbytes - pos)
        if k or into != "reused":
            tx += time.thread_time() - t0
    th.join()
    os.close(fd)
    for s in (out, conn, srv):
        s.close()
    src.unlink()
    return tx / times, rx_cpu[0] / times


def _floor_s(nbytes: int, times: int) -> float:
    """CPU seconds of the floor for one save of ``nbytes``: copy + XXH3 + both ends of a TCP transfer."""
    return _copy_hash_s(nbytes, times) + sum(_tcp_s(nbytes, times, Path("/dev/shm")))


_ECHO = """
import socket, sys
srv = socket.socket(socket.AF_UNIX); srv.bind(sys.argv[1]); srv.listen(1)
print("ready", flush=True)
conn, _ = srv.accept(); f = conn.makefile("rb")
for line in f:
    conn.sendall(b'{"ok": true}\\n')
"""


def _ping_pong_us(times: int, where: Path) -> float:
    """A bare Unix-socket round trip: a JSON-sized line to another Python process and its answer
    (what the daemon's control socket does, without the daemon)."""
    path = where / "echo.sock"
    path.unlink(missing_ok=True)  # the previous repeat's
    echo = subprocess.Popen([sys.executable, "-c", _ECHO, str(path)], stdout=subprocess.PIPE)
    try:
        assert echo.stdout is not None and echo.stdout.readline().strip() == b"ready"
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(path))
        f = s.makefile("rb")
        line = b'{"op": "ping"}\n'
        t0 = time.perf_counter()
        for _ in range(times):
            s.sendall(line)
            f.readline()
        took = time.perf_counter() - t0
        s.close()
    finally:
        echo.kill()
        echo.wait()
    return took / times * 1e6


def _daemon_ping_us(socket_path: Path, times: int) -> float:
    client = DaemonClient(socket_path, 10.0)
    try:
        t0 = time.perf_counter()
        for _ in range(times):
            client.call(proto.Ping())
        return (time.perf_counter() - t0) / times * 1e6
    finally:
        client.close()


# --- the cases -------------------------------------------------------------------------------
def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _small(ck: Checkpointer, loop: Loop | _Fsdp2State, pids: tuple[int, int], saves: int, first: int, gap_s: float) -> dict[str, float]:
    me = threading.get_native_id()
    ck.save(first, loop.state(first))
    ck.wait()
    client0, sender0, receiver0 = cpu_by_thread(os.getpid()), cpu_s(pids[0]), cpu_s(pids[1])
    save_s = 0.0
    for i in range(1, saves + 1):
        state = loop.state(first + i)  # the caller's state_dict() calls are not the save's cost
        t = time.thread_time()
        ck.save(first + i, state)
        # the young collection of what the save made, which a save that holds the collector off
        # leaves to the caller's next allocations: counted here, where it belongs
        gc.collect(0)
        save_s += time.thread_time() - t
        _spin(gap_s)
    t = time.thread_time()
    ck.wait()
    save_s += time.thread_time() - t  # the last commit's reply
    client1, sender1, receiver1 = cpu_by_thread(os.getpid()), cpu_s(pids[0]), cpu_s(pids[1])
    python_threads = {t.native_id for t in threading.enumerate()}

    def delta(keep: Any) -> float:
        return sum(v - client0.get(tid, 0.0) for tid, v in client1.items() if keep(tid))

    per = {
        "save_ms": save_s,
        "worker_other_ms": delta(lambda tid: tid != me and tid in python_threads),
        "sender_ms": sender1 - sender0,
        "receiver_ms": receiver1 - receiver0,
    }
    per = {k: v / saves * 1e3 for k, v in per.items()}
    per["total_ms"] = sum(per.values())
    per["torch_threads_ms"] = delta(lambda tid: tid not in python_threads) / saves * 1e3
    return per


class _Fsdp2State:
    """The ``fsdp2`` case: 150 ``Linear(64, 64)`` layers, each ``fully_shard``-ed, and AdamW, on a
    one-rank gloo group; its ``get_state_dict`` is 1,200 tensors (900 DTensors) in 7.6 MiB — a
    large model's count of tensors at a small size, where a save's cost per tensor shows."""

    def __init__(self, work: Path) -> None:
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo", store=dist.FileStore(str(work / "fsdp2-group"), 1), rank=0, world_size=1)
        torch.manual_seed(0)
        layers = [torch.nn.Linear(64, 64) for _ in range(150)]
        self.model = torch.nn.Sequential(*layers)
        for layer in layers:
            fully_shard(layer)
        fully_shard(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def step(self) -> None:
        self.model(torch.randn(4, 64)).sum().backward()
        self.opt.step()

    def state(self, step: int) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.opt)
        return {"model": model, "optim": optim, "step": step}

    @staticmethod
    def close() -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


_PER_SAVE = ("cnn", "fsdp2")  # the cases measured per save (the others per GiB)


def _large_state(mib: int) -> dict[str, torch.Tensor]:
    n = (mib << 20) // 4 // 8
    g = torch.Generator().manual_seed(mib)
    return {f"w{i}": torch.randn(n, generator=g) for i in range(8)}


def _large(ck: Checkpointer, state: dict[str, torch.Tensor], pids: tuple[int, int], saves: int, first: int) -> dict[str, float]:
    """Per GiB, every thread of each process: ``saves`` saves, each waited for (its commit waits for its replica)."""
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    me = os.getpid()
    before = cpu_s(me), cpu_s(pids[0]), cpu_s(pids[1])
    for i in range(saves):
        state["w0"][0] = float(first + i)  # each step's bytes differ
        ck.save(first + i, state)
        ck.wait()
    after = cpu_s(me), cpu_s(pids[0]), cpu_s(pids[1])
    gib = saves * nbytes / GIB
    per = {f"{k}_s_per_gib": (a - b) / gib for k, a, b in zip(("worker", "sender", "receiver"), after, before)}
    per["total_s_per_gib"] = sum(per.values())
    return per


def _get(cluster: LocalCluster, node: int) -> dict[str, Any]:
    state: dict[str, Any] = httpx.get(cluster.daemons[node].url + "/v1/state").json()
    return state


def _replicated_to(cluster: LocalCluster, step: int) -> bool:
    state = _get(cluster, 0)
    return any(r["replicated"] == step for r in (state["replication"] or {}).get("roles", {}).values())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="cnn,fsdp2,256,1024", help="cnn (4 MiB), fsdp2 (1,200 tensors) and/or sizes in MiB per role")
    p.add_argument("--saves", type=int, default=600, help="saves per repeat of the cnn case (large cases: 8 of 256 MiB, 3 of 1 GiB)")
    p.add_argument("--fsdp2-saves", type=int, default=100, help="saves per repeat of the fsdp2 case")
    p.add_argument("--gap-ms", type=float, default=3.0, help="busy-looping between saves (cnn and fsdp2 cases)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--transport", choices=["bulk", "http"], default="bulk", help="how node 0 pushes replicas to node 1")
    p.add_argument("--gate-chunk-kb", type=int, default=64, help="the daemons' --gate-chunk-kb (their default)")
    p.add_argument("--copy-threads", type=int, default=None, help="Checkpointer copy_threads (default: its own)")
    p.add_argument("--out", default="save_cpu")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    cases = args.cases.split(",")
    bad = [c for c in cases if c not in _PER_SAVE and not c.isdigit()]
    if bad:
        raise SystemExit(f"--cases takes {', '.join(_PER_SAVE)} and sizes in MiB, got {bad}")
    mib = sum(int(c) for c in cases if c not in _PER_SAVE) + 16  # every case's role keeps its slots to the end
    samples: dict[str, list[float]] = {}
    sizes: dict[str, int] = {}
    parts: dict[str, Any] = {}  # the daemons' own account of a commit's and a replica's fixed costs
    with tempfile.TemporaryDirectory(prefix="ffplane-save-cpu-", dir="/tmp") as tmp:
        work = Path(tmp)
        (work / "data").mkdir()
        daemon_args = ["--log-level", "warning", "--gate-chunk-kb", str(args.gate_chunk_kb)]
        if args.transport == "http":
            daemon_args += ["--bulk-port", "-1"]
        budget = 256 + 4 * mib  # four slots of every case's state on node 0, three replica files on node 1
        with LocalCluster(work, work / "data", secrets.token_hex(16)) as cluster:
            cluster.start_dataserver("--log-level", "warning")
            daemons = [cluster.start_daemon(*daemon_args, budget_mb=budget) for _ in range(2)]
            pids = (daemons[0].pid, daemons[1].pid)
            cluster.until_successor(0, "n1")  # else the first saves go unreplicated (receiver_ms 0, seen under load)
            step = 0
            for case in cases:
                ck = Checkpointer(f"save-cpu-{case}", socket_path=cluster.socket(0), copy_threads=args.copy_threads)
                try:
                    if case in _PER_SAVE:
                        loop = Loop("cnn", 0) if case == "cnn" else _Fsdp2State(work)
                        loop.step()  # AdamW state exists
                        sizes[case] = sum(encode(loop.state(0)).stream_nbytes.values())
                        for _ in range(WARM_SAVES):  # and node 0 knows its successor
                            ck.save(step, loop.state(step))
                            ck.wait()
                            step += 1
                        saves = args.saves if case == "cnn" else args.fsdp2_saves
                        for _ in range(args.repeats):
                            for k, v in _small(ck, loop, pids, saves, step, args.gap_ms / 1e3).items():
                                samples.setdefault(f"{case}_{k}", []).append(v)
                            step += saves + 1
                            # right after the saves it is set beside, and over as many of them: a
                            # 4 MiB transfer's CPU swings with where the scheduler puts its two
                            # ends (50 transfers, measured after every case: 1.4-3.0 ms a save)
                            samples.setdefault(f"{case}_floor_ms", []).append(_floor_s(sizes[case], saves) * 1e3)
                            if case == "cnn":
                                samples.setdefault("round_trip_us", []).append(_daemon_ping_us(cluster.socket(0), 2000))
                                samples.setdefault("round_trip_floor_us", []).append(_ping_pong_us(2000, work))
                        if case == "cnn":
                            parts["commit"] = _get(cluster, 0)["commit_parts"]
                            parts["replica_finish"] = _get(cluster, 1)["replica_parts"]
                    else:
                        state = _large_state(int(case))
                        sizes[case] = sum(t.numel() * t.element_size() for t in state.values())
                        for _ in range(WARM_SAVES):
                            ck.save(step, state)
                            ck.wait()
                            step += 1
                        if not _replicated_to(cluster, step - 1):
                            raise SystemExit("node 0's commits were not replicated: is node 1 in its ring?")
                        saves = 3 if int(case) >= 1024 else 8
                        for _ in range(args.repeats):
                            for k, v in _large(ck, state, pids, saves, step).items():
                                samples.setdefault(f"{case}mib_{k}", []).append(v)
                            step += saves
                        del state
                finally:
                    ck.close()
                    if case == "fsdp2" and torch.distributed.is_initialized():
                        _Fsdp2State.close()  # even after a failure: a smoke run shares its process with other tests
        for case, nbytes in sizes.items():
            if case in _PER_SAVE:
                continue  # its floor was measured beside its saves
            for _ in range(args.repeats):
                floor = _floor_s(nbytes, 1)
                samples.setdefault(f"{case}mib_floor_s_per_gib", []).append(floor / (nbytes / GIB))
                for into in ("fresh", "reused"):  # what receiving into a new tmpfs file costs against one whose pages exist
                    rx = _tcp_s(nbytes, 1, Path("/dev/shm"), into)[1]
                    samples.setdefault(f"{case}mib_receive_{into}_file_s_per_gib", []).append(rx / (nbytes / GIB))
    figures = {k: summary(v) for k, v in samples.items()}
    checks: dict[str, Any] = {}
    for case in sizes:
        if case == "cnn":
            checks["cnn_total_vs_floor"] = {"ratio": ratio(figures["cnn_total_ms"], figures["cnn_floor_ms"]), "target": "<= 2.0"}
            checks["round_trip_vs_floor"] = {
                "ratio": ratio(figures["round_trip_us"], figures["round_trip_floor_us"]),
                "target": "(reported: the control socket's ping against a bare Unix-socket ping-pong)",
            }
        elif case == "fsdp2":
            checks["fsdp2_total_vs_floor"] = {"ratio": ratio(figures["fsdp2_total_ms"], figures["fsdp2_floor_ms"]), "target": "(reported)"}
        else:
            key = f"{case}mib"
            target = "<= 1.5" if int(case) >= 1024 else "(reported)"
            checks[f"{key}_total_vs_floor"] = {
                "ratio": ratio(figures[f"{key}_total_s_per_gib"], figures[f"{key}_floor_s_per_gib"]),
                "target": target,
            }
    config = {
        "cases": cases,
        "state_bytes": sizes,
        "saves": args.saves,
        "fsdp2_saves": args.fsdp2_saves,
        "gap_ms": args.gap_ms,
        "repeats": args.repeats,
        "transport": args.transport,
        "gate_chunk_kb": args.gate_chunk_kb,
        "copy_threads": args.copy_threads,
        "torch_threads": torch.get_num_threads(),
        "daemon_parts_us": parts,
    }
    out = write_results(args.out, figures, config, checks, args.results_dir)
    for case in _PER_SAVE:
        print_table([(k, v, "") for k, v in figures.items() if k.startswith(f"{case}_")], f"CPU ms per save ({case})")
    print_table([(k, v, "") for k, v in figures.items() if not k.startswith(_PER_SAVE)], "CPU s per GiB saved")
    for k, c in checks.items():
        print(f"  {k} {c['ratio']:.2f} (target {c['target']})")
    for k, v in parts.items():
        print(f"  {k} (daemon's account, mean us): {v}")
    print(f"wrote {out}")
    return {"figures": figures, "targets": checks}


if __name__ == "__main__":
    main()
