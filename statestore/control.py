"""The local control channel between workers and the daemon: one Unix socket, JSON lines.

A per-batch HTTP request would cost more than the batch lookup itself; a Unix-socket round trip
costs tens of microseconds. The socket is created mode 0600 inside the daemon's root, so only the
node's training user reaches it. Requests and replies are single JSON lines:

* ``{"op": "open", "job": J, "dp_rank": r, "token": T?}`` → ``{"ok": true}``: this connection
  reads dp rank ``r`` of job ``J`` (``token`` lets the daemon fetch for that job);
* ``{"op": "get", "step": s}`` → ``{"ok": true, "path": P, "nbytes": n, "hit": bool}`` once step
  ``s`` is cached at ``<root>/P``; or ``{"ok": false, "status": 416, "error": "..."}``.

The connection's last ``get`` is the reader's position: it drives prefetch and eviction. Closing
the connection (a crashed worker included) removes the reader but keeps its cached steps.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
from pathlib import Path
from typing import Any

from statestore.data_cache import DataCache, FetchError, Stream

log = logging.getLogger(__name__)
_MAX_LINE = 64 << 10
_reader_ids = itertools.count(1)


class ControlServer:
    def __init__(self, cache: DataCache, path: Path) -> None:
        self.cache = cache
        self.path = path
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.path.unlink(missing_ok=True)  # a socket file left by a killed daemon
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path), limit=_MAX_LINE)
        os.chmod(self.path, 0o600)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self.path.unlink(missing_ok=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rid = next(_reader_ids)
        stream: Stream | None = None
        try:
            while line := await reader.readline():
                try:
                    msg = json.loads(line)
                    if not isinstance(msg, dict):
                        raise ValueError("expected a JSON object")
                    reply, stream = await self._handle(rid, msg, stream)
                except (ValueError, KeyError, TypeError) as exc:
                    reply = {"ok": False, "status": 400, "error": f"bad request: {exc}"}
                except FetchError as exc:
                    reply = {"ok": False, "status": exc.status, "error": str(exc)}
                writer.write(json.dumps(reply).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            if stream is not None:
                self.cache.detach(rid, stream)
            writer.close()

    async def _handle(self, rid: int, msg: dict[str, Any], stream: Stream | None) -> tuple[dict[str, Any], Stream | None]:
        op = msg.get("op")
        if op == "open":
            job, dp_rank = str(msg["job"]), int(msg["dp_rank"])
            if "/" in job or job.startswith(".") or not job or dp_rank < 0:
                raise ValueError(f"invalid job {job!r} or dp_rank {dp_rank}")
            if stream is not None:
                self.cache.detach(rid, stream)
            stream = self.cache.attach(rid, job, dp_rank, msg.get("token"))
            log.info("reader attached", extra={"job": job, "dp_rank": dp_rank, "reader": rid})
            return {"ok": True, "root": str(self.cache.config.root)}, stream
        if op == "get":
            if stream is None:
                raise ValueError("send 'open' before 'get'")
            step = int(msg["step"])
            if step < 0:
                raise ValueError(f"step must be >= 0, got {step}")
            cached, hit = await self.cache.get(rid, stream, step)
            rel = str(cached.path.relative_to(self.cache.config.root))
            return {"ok": True, "path": rel, "nbytes": cached.nbytes, "hit": hit}, stream
        if op == "ping":
            return {"ok": True}, stream
        raise ValueError(f"unknown op {op!r}; expected open, get or ping")
