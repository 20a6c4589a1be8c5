"""Traffic makers for the network benchmarks, run as processes inside a node's namespace.

    python -m bench._traffic sink PORT                          # answers every message with one byte
    python -m bench._traffic stream HOST PORT MB                # raw TCP: one MB-sized message, prints seconds
    python -m bench._traffic train HOST PORT BURSTS MB GAP_MS [SOCKET]
        # TRAIN: BURSTS collective-sized messages of MB separated by GAP_MS of compute; with the
        # daemon SOCKET, every burst is announced through trainer_client.LinkHints. Prints JSON.
    python -m bench._traffic saver SOCKET JOB MB [EVERY_S]      # STATE: saves an MB state every EVERY_S (0.3)

Messages are an 8-byte length and the bytes; the sink acknowledges each with one byte, so the
sender's clock covers delivery (like a collective's completion), not only the socket write.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import threading
import time

_CHUNK = 1 << 20


def _send_message(sock: socket.socket, payload: memoryview) -> None:
    sock.sendall(struct.pack("<Q", len(payload)))
    sock.sendall(payload)
    if sock.recv(1) != b"k":
        raise ConnectionError("sink closed before acknowledging")


def sink(port: int) -> None:
    server = socket.create_server(("0.0.0.0", port), reuse_port=True)
    print("ready", flush=True)

    def serve(conn: socket.socket) -> None:
        buf = bytearray(_CHUNK)
        with conn:
            while True:
                head = conn.recv(8, socket.MSG_WAITALL)
                if len(head) < 8:
                    return
                (left,) = struct.unpack("<Q", head)
                while left:
                    n = conn.recv_into(buf, min(left, _CHUNK))
                    if not n:
                        return
                    left -= n
                conn.sendall(b"k")

    while True:
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def _connect(host: str, port: int) -> socket.socket:
    deadline = time.monotonic() + 10
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=30)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def stream(host: str, port: int, mb: float) -> None:
    payload = memoryview(bytearray(int(mb * 2**20)))
    with _connect(host, port) as sock:
        _send_message(sock, payload[:4096])  # connection warmed up
        started = time.perf_counter()
        _send_message(sock, payload)
        print(json.dumps({"seconds": time.perf_counter() - started, "bytes": len(payload)}), flush=True)


def train(host: str, port: int, bursts: int, mb: float, gap_ms: float, daemon_socket: str | None) -> None:
    from contextlib import nullcontext

    hints = None
    if daemon_socket:
        from trainer_client.link_hints import LinkHints

        hints = LinkHints(daemon_socket)
    payload = memoryview(bytearray(int(mb * 2**20)))
    burst_s = []
    with _connect(host, port) as sock:
        _send_message(sock, payload[:4096])
        started, wall = time.perf_counter(), time.time()
        for _ in range(bursts):
            time.sleep(gap_ms / 1000)  # compute: the link is idle
            t = time.perf_counter()
            with hints.collective() if hints else nullcontext():
                _send_message(sock, payload)
            burst_s.append(time.perf_counter() - t)
        total = time.perf_counter() - started
    if hints is not None:
        hints.close()
    print(
        json.dumps({"total_s": total, "burst_s": burst_s, "bytes": bursts * len(payload), "start": wall, "end": wall + total}), flush=True
    )


def saver(daemon_socket: str, job: str, mb: float, every_s: float) -> None:
    import torch

    from trainer_client import Checkpointer

    ck = Checkpointer(job, socket_path=daemon_socket)
    state = {"w": torch.zeros(int(mb * 2**20) // 4)}
    print("ready", flush=True)
    step = 0
    while True:
        state["w"][0] = step
        ck.save(step, state)
        ck.wait()
        step += 1
        time.sleep(every_s)


def main(argv: list[str]) -> None:
    kind = argv[0]
    if kind == "sink":
        sink(int(argv[1]))
    elif kind == "stream":
        stream(argv[1], int(argv[2]), float(argv[3]))
    elif kind == "train":
        train(argv[1], int(argv[2]), int(argv[3]), float(argv[4]), float(argv[5]), argv[6] if len(argv) > 6 else None)
    elif kind == "saver":
        saver(argv[1], argv[2], float(argv[3]), float(argv[4]) if len(argv) > 4 else 0.3)
    else:
        raise SystemExit(f"unknown traffic kind {kind!r}; see the module docstring")


if __name__ == "__main__":
    main(sys.argv[1:])
