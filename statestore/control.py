"""The daemon's side of the control socket (the protocol: ``ffplane_contract.control``).

A reader may map a published step file without waiting: it sends ``Get`` and reads the reply
later. Published files never change, so the bytes are the same either way, and the daemon still
sees every position; the reader saves the round trip's wait and, on a 2-core node, the context
switches that came with it.

That is why ``open`` is answered only once the cache has the job's plan from the data server (or
``_PLAN_WAIT_S`` has passed): every file a reader can then find by its step's name holds the
step as the job plans it now (``DataCache.check_plan``), so readers check no generations.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import struct
from pathlib import Path
from typing import Any

from ffplane_contract import control as proto
from ffplane_contract.errors import FFPlaneError
from statestore.data_cache import DataCache, Stream
from statestore.heartbeat import Heartbeat
from statestore.procs import alive
from statestore.slots import RESERVED
from statestore.state_service import StateService

log = logging.getLogger(__name__)
_reader_ids = itertools.count(1)
_PLAN_WAIT_S = 2.0  # an open waits this long for the job's plan (a data server that does not answer)


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
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path), limit=proto.MAX_LINE)
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
                    out = proto.encode(await self._handle(rid, proto.decode_request(line), conn))
                except (ValueError, KeyError, TypeError) as exc:
                    out = proto.encode_error(FFPlaneError(f"bad request: {exc}", 400))
                except FFPlaneError as exc:
                    out = proto.encode_error(exc)
                except Exception as exc:  # noqa: BLE001 - answer it; a dropped connection explains nothing
                    log.exception("control request failed")
                    out = proto.encode_error(FFPlaneError(f"daemon error: {exc!r}", 500))
                writer.write(out)
                await writer.drain()
        except (asyncio.LimitOverrunError, ValueError):  # a line over the limit: say so, then close
            try:
                writer.write(proto.encode_error(FFPlaneError(f"request line over {proto.MAX_LINE} bytes", 413)))
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

    async def _handle(self, rid: int, req: proto.Request, conn: _Conn) -> Any:
        root = self.state.root
        if isinstance(req, proto.Get):
            if conn.stream is None:
                raise ValueError("send 'open' before 'get'")
            cached, hit = await self.cache.get(rid, conn.stream, req.step)
            return proto.GetReply(str(cached.path.relative_to(self.cache.config.root)), cached.nbytes, hit)
        if isinstance(req, proto.Open):
            if conn.stream is not None:
                self.cache.detach(rid, conn.stream)
            conn.stream = self.cache.attach(rid, req.job, req.dp_rank, req.token)
            await self.cache.check_plan(conn.stream, _PLAN_WAIT_S)  # before the reader maps a step by its name
            self._register(rid, conn, job=req.job, dp_rank=req.dp_rank)
            log.info("reader attached", extra={"job": req.job, "dp_rank": req.dp_rank, "reader": rid})
            return proto.OpenReply(str(self.cache.config.root), str(conn.stream.directory.relative_to(self.cache.config.root)))
        if isinstance(req, proto.Alloc):
            paths = await self.state.slots.alloc(req.job, req.role, req.nbytes)
            wait = self.state.replicator.wait_s if self.state.replicator is not None and self.state.replicator.max_lag > 0 else 0.0
            return proto.AllocReply([str(root / p) for p in paths], wait)
        if isinstance(req, proto.Begin):
            self._release_reserved(req.job, req.role, conn)  # a writer that begins holds none it uses
            slot = await self.state.begin(req.job, req.role, req.step, req.settled)
            self._register(rid, conn, job=req.job, role=req.role)
            conn.writing.add((req.job, req.role, slot))
            return proto.Grant(slot, str(root / slot))
        if isinstance(req, proto.Abort):
            self.state.slots.abandon(req.job, req.role, req.slot)
            conn.writing.discard((req.job, req.role, req.slot))
            return proto.Done()
        if isinstance(req, proto.Commit):
            version = await self.state.commit(
                req.job,
                req.role,
                req.step,
                req.slot,
                req.nbytes,
                req.header,
                req.save_block_s,
                reserved=req.reserved,
                settled=req.settled,
                static=req.static,
                static_header=req.static_header,
            )
            conn.writing.discard((req.job, req.role, req.slot))
            return proto.CommitReply(version.checksum, self._reserve(req.job, req.role, conn))
        if isinstance(req, proto.Restorable):
            return proto.RestorableReply(**await self.state.restorable(req.job, req.verify, req.below, req.roles, req.step))
        if isinstance(req, proto.Verify):
            bad = await self.state.verify(req.job, req.step, req.roles)
            return proto.VerifyReply(not bad, bad)
        if isinstance(req, proto.Bye) and self.heartbeat is not None:
            self.heartbeat.worker_ending(conn.pid)
        return proto.Done()  # Ping, Bye

    def _reserve(self, job: str, role: str, conn: _Conn) -> proto.Grant | None:
        """The slot for this role's next save, handed out with the commit reply: the save then
        needs no ``begin`` round trip (see docs/decisions.md, "One request per save")."""
        try:
            reserved = self.state.reserve(job, role)
        except FFPlaneError:
            return None
        if reserved is None:
            return None  # none free now (a durable copy holds it): the next save sends 'begin'
        slot, settled_only = reserved
        conn.writing.add((job, role, slot))
        return proto.Grant(slot, f"{self.state.root}/{slot}", settled_only)

    def _release_reserved(self, job: str, role: str, conn: _Conn) -> None:
        """Give back a slot reserved for this connection's role that its writer did not take."""
        rs = self.state.slots.roles.get((job, role))
        for key in [k for k in conn.writing if k[:2] == (job, role)]:
            if rs is not None and rs.writing.get(key[2]) == RESERVED:
                self.state.slots.abandon(job, role, key[2])
                conn.writing.discard(key)

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
