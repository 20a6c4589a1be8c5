"""The ceiling the required HTTP stack puts under the data path on this machine.

A FastAPI app on uvicorn (as ``dataserver serve`` runs it: uvloop and httptools when installed)
returns one constant body of a step's size; an aiohttp client (as the daemon's: ``fetch``
requests in flight, chunks taken as aiohttp buffered them and dropped) reads it over loopback.
No planning, no gather, no tmpfs write and no reader: whatever the end-to-end path does on top
can only be slower. The CPU it spends per GB also gives a bound that counts the path's own work:
with the three copies the path adds (the server's gather, the daemon's tmpfs write, the reader's
copy, each at ``memcpy_gbps``), ``cores / (stack CPU per GB + 3 / memcpy_gbps)`` is the most the
whole path could reach with no other overhead at all.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import aiohttp

from bench._common import cpu_s

GB = 1e9

_SERVER = r"""
import sys
import uvicorn
from fastapi import FastAPI
from fastapi.responses import Response

app = FastAPI()
body = b"\0" * int(sys.argv[2])

@app.get("/body")
async def constant() -> Response:
    return Response(body, media_type="application/vnd.apache.arrow.stream")

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _read_all(url: str, body_bytes: int, requests: int, in_flight: int, server_pid: int) -> tuple[float, float]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=in_flight * 2)) as session:
        gate = asyncio.Semaphore(in_flight)

        async def one() -> None:
            async with gate, session.get(url) as resp:
                got = 0
                async for chunk, _ in resp.content.iter_chunks():
                    got += len(chunk)
                if got != body_bytes:
                    raise RuntimeError(f"short body: {got} of {body_bytes} bytes")

        await asyncio.gather(*(one() for _ in range(in_flight)))  # connections open, pages warm
        t, cpu = time.perf_counter(), time.process_time() + cpu_s(server_pid)
        await asyncio.gather(*(one() for _ in range(requests)))
        seconds, cpu = time.perf_counter() - t, time.process_time() + cpu_s(server_pid) - cpu
        gb = requests * body_bytes / GB
        return gb / seconds, cpu / gb


def http_stack(body_bytes: int, total_bytes: int, in_flight: int = 4) -> tuple[float, float]:
    """Constant ``body_bytes`` responses, FastAPI/uvicorn → aiohttp, ``in_flight`` at once:
    (GB/s, CPU seconds per GB of server and client together)."""
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-c", _SERVER, str(port), str(body_bytes)])
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the bare FastAPI server did not start (exit {server.poll()})") from None
                time.sleep(0.1)
        requests = max(in_flight, total_bytes // body_bytes)
        return asyncio.run(_read_all(f"http://127.0.0.1:{port}/body", body_bytes, requests, in_flight, server.pid))
    finally:
        server.kill()
        server.wait()
