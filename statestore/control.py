"""The local control channel between workers and the daemon: one Unix socket, JSON lines.

A per-batch HTTP request would cost more than the batch lookup itself; a Unix-socket round trip
costs tens of microseconds. The socket is created mode 0600 inside the daemon's root, so only the
node's training user reaches it. Requests and replies are single JSON lines:

* ``{"op": "open", "job": J, "dp_rank": r, "token": T?}`` → ``{"ok": true, "root": R, "steps":
  D}``: this connection reads dp rank ``r`` of job ``J`` (``token`` lets the daemon fetch for that
  job); cached step ``s`` is published as ``<R>/<D>/<s:012d>.arrow``;
* ``{"op": "get", "step": s}`` → ``{"ok": true, "path": P, "nbytes": n, "hit": bool}`` once step
  ``s`` is cached at ``<root>/P``; or ``{"ok": false, "status": 416, "error": "..."}``.

The connection's last ``get`` is the reader's position: it drives prefetch and eviction. Closing
the connection (a crashed worker included) removes the reader but keeps its cached steps.

State requests (``Checkpointer``): ``alloc`` (a role's slots), ``begin`` (a slot for a step),
``commit`` (checksum and record it; the reply carries ``next``, the slot reserved for the role's
next save, so a steady-state save is this one request, sent without waiting for its reply;
``static`` names the header's unchanging part, sent as ``static_header`` only when it changes),
``abort``, ``restorable`` and ``verify``.

A reader may map a published step file without waiting: it sends ``get`` and reads the reply
later (replies come in request order). Published files never change, so the bytes are the same
either way, and the daemon still sees every position; the reader saves the round trip's wait
and, on a 2-core node, the context switches that came with it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import socket
import struct
from pathlib import Path
from typing import Any

from statestore.data_cache import DataCache, FetchError, Stream
from statestore.heartbeat import Heartbeat
from statestore.names import check_name, check_step
from statestore.procs import alive
from statestore.state_service import StateService
from statestore.slots import RESERVED, SlotError

log = logging.getLogger(__name__)
_MAX_LINE = 64 << 20  # a commit carries the shard header (one entry per tensor)
_reader_ids = itertools.count(1)


class ControlServer:
    def __init__(self, cache: DataCache, state: StateService, path: Path, heartbeat: Heartbeat | None = None) -> None:
        self.cache = cache
        self.state = state
        self.path = path
        self.heartbeat = heartbeat
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Future[None]] = set()

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
        conn = _Conn()
        conn.pid = _peer_pid(writer)
        try:
            while line := await reader.readline():
                try:
                    msg = json.loads(line)
                    if not isinstance(msg, dict):
                        raise ValueError("expected a JSON object")
                    reply = await self._handle(rid, msg, conn)
                except (ValueError, KeyError, TypeError) as exc:
                    reply = {"ok": False, "status": 400, "error": f"bad request: {exc}"}
                except (FetchError, SlotError) as exc:
                    reply = {"ok": False, "status": exc.status, "error": str(exc)}
                except Exception as exc:  # noqa: BLE001 - answer it; a dropped connection explains nothing
                    log.exception("control request failed", extra={"op": msg.get("op") if isinstance(msg, dict) else None})
                    reply = {"ok": False, "status": 500, "error": f"daemon error: {exc!r}"}
                writer.write(json.dumps(reply).encode() + b"\n")
                await writer.drain()
        except (asyncio.LimitOverrunError, ValueError):  # a line over the limit: say so, then close
            try:
                writer.write(json.dumps({"ok": False, "status": 413, "error": f"request line over {_MAX_LINE} bytes"}).encode() + b"\n")
                await writer.drain()
            except ConnectionError:
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            if conn.stream is not None:
                self.cache.detach(rid, conn.stream)
            for job, role, slot in conn.writing:  # a worker killed mid-save: its slot is free again
                self.state.slots.abandon(job, role, slot)
            if self.heartbeat is not None:
                info = self.heartbeat.workers.pop(rid, None)
                if info is not None:
                    task = asyncio.ensure_future(self._report_if_exited(conn.pid, info))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
            writer.close()

    async def _report_if_exited(self, pid: int, info: dict[str, Any]) -> None:
        """A SIGKILLed worker's sockets close while the kernel is still tearing the process down
        (not yet a zombie), so look again for a moment before deciding it only disconnected."""
        assert self.heartbeat is not None
        for _ in range(20):
            if not alive(pid):
                self.heartbeat.worker_gone(info)
                return
            await asyncio.sleep(0.05)

    async def _handle(self, rid: int, msg: dict[str, Any], conn: _Conn) -> dict[str, Any]:
        op = msg.get("op")
        if op == "open":
            job, dp_rank = check_name(msg["job"]), int(msg["dp_rank"])
            if dp_rank < 0:
                raise ValueError(f"invalid dp_rank {dp_rank}")
            if conn.stream is not None:
                self.cache.detach(rid, conn.stream)
            conn.stream = self.cache.attach(rid, job, dp_rank, msg.get("token"))
            self._register(rid, conn, job=job, dp_rank=dp_rank)
            log.info("reader attached", extra={"job": job, "dp_rank": dp_rank, "reader": rid})
            return {"ok": True, "root": str(self.cache.config.root), "steps": str(conn.stream.directory.relative_to(self.cache.config.root))}
        if op == "get":
            if conn.stream is None:
                raise ValueError("send 'open' before 'get'")
            step = int(msg["step"])
            if step < 0:
                raise ValueError(f"step must be >= 0, got {step}")
            cached, hit = await self.cache.get(rid, conn.stream, step)
            rel = str(cached.path.relative_to(self.cache.config.root))
            return {"ok": True, "path": rel, "nbytes": cached.nbytes, "hit": hit}
        if op == "invalidate":
            if conn.stream is None:
                raise ValueError("send 'open' before 'invalidate'")
            self.cache.invalidate(conn.stream, check_step(msg["step"]))
            return {"ok": True}
        if op == "alloc":
            paths = await self.state.slots.alloc(check_name(msg["job"]), check_name(msg["role"]), int(msg["nbytes"]))
            wait = self.state.replicator.wait_s if self.state.replicator is not None and self.state.replicator.max_lag > 0 else 0.0
            return {"ok": True, "paths": [str(self.state.root / p) for p in paths], "commit_wait_s": wait}
        if op == "begin":
            job, role, step = check_name(msg["job"]), check_name(msg["role"]), check_step(msg["step"])
            slot = self.state.begin(job, role, step)
            self._register(rid, conn, job=job, role=role)
            conn.writing.add((job, role, slot))
            return {"ok": True, "slot": slot, "path": str(self.state.root / slot)}
        if op == "abort":
            job, role, slot = check_name(msg["job"]), check_name(msg["role"]), str(msg["slot"])
            self.state.slots.abandon(job, role, slot)
            conn.writing.discard((job, role, slot))
            return {"ok": True}
        if op == "commit":
            job, role, slot = check_name(msg["job"]), check_name(msg["role"]), str(msg["slot"])
            if not isinstance(msg.get("header"), dict):
                raise ValueError("commit needs a JSON object 'header'")
            static, static_header = str(msg.get("static", "")), msg.get("static_header")
            if static_header is not None and not (isinstance(static_header, dict) and static):
                raise ValueError("'static_header' must be a JSON object, sent with its digest 'static'")
            version = await self.state.commit(
                job, role, check_step(msg["step"]), slot, int(msg["nbytes"]), msg["header"], float(msg.get("save_block_s", 0.0)),
                reserved=bool(msg.get("reserved", False)), static=check_name(static) if static else "", static_header=static_header,
            )
            conn.writing.discard((job, role, slot))
            return {"ok": True, "checksum": version.checksum, "next": self._reserve(job, role, conn)}
        if op == "restorable":
            below = msg.get("below")
            roles, at = msg.get("roles"), msg.get("step")
            found = await self.state.restorable(
                check_name(msg["job"]), bool(msg.get("verify", True)), None if below is None else int(below),
                None if roles is None else [check_name(r) for r in roles], None if at is None else check_step(at),
            )
            return {"ok": True, **found}
        if op == "verify":
            roles = msg.get("roles")
            bad = await self.state.verify(check_name(msg["job"]), check_step(msg["step"]), None if roles is None else [check_name(r) for r in roles])
            return {"ok": True, "intact": not bad, "corrupt": bad}
        if op == "ping":
            return {"ok": True}
        raise ValueError(f"unknown op {op!r}; expected open, get, invalidate, alloc, begin, abort, commit, restorable, verify or ping")

    def _reserve(self, job: str, role: str, conn: _Conn) -> dict[str, str] | None:
        """The slot for this role's next save, handed out with the commit reply: the save then
        needs no ``begin`` round trip (see docs/decisions.md, "One request per save")."""
        try:
            slot = self.state.begin(job, role, RESERVED)
        except SlotError:
            return None  # none free now (a durable copy holds it): the next save sends 'begin'
        conn.writing.add((job, role, slot))
        return {"slot": slot, "path": str(self.state.root / slot)}

    def _register(self, rid: int, conn: _Conn, **what: object) -> None:
        if self.heartbeat is not None:
            self.heartbeat.workers.setdefault(rid, {"pid": conn.pid}).update(what)


class _Conn:
    """What one client connection holds: its peer, the stream it reads, the slots it writes."""

    def __init__(self) -> None:
        self.pid = 0
        self.stream: Stream | None = None
        self.writing: set[tuple[str, str, str]] = set()


def _peer_pid(writer: asyncio.StreamWriter) -> int:
    sock = writer.get_extra_info("socket")
    try:
        pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        return int(pid)
    except (OSError, AttributeError):
        return 0
