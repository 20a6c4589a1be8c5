"""The bulk channel: replica pushes on a TCP port of their own, sent from the shard's file with
``sendfile`` and received straight into the replica's mapped file, hashed as each piece lands.

Why not the HTTP routes (which remain, for pulls, questions and peers without a bulk port): uvicorn
hands a request body over as fresh ``bytes`` objects, so every byte pushed cost an allocation, a
copy into the file and the HTTP machinery per piece, and the sender staged a private copy of the
shard before sending. Here a byte is copied once by the sender's kernel and once by the
receiver's, as in a bare TCP transfer (``bench/save_cpu.py`` measures both; docs/decisions.md
"Replicas on a bulk channel").

A sender learns a peer's bulk port from ``GET /v1/transfer`` on its HTTP address, once. Frames are
``bulk_wire``'s; one connection per peer carries one push after another. A push passes the link
gate a chunk at a time, as HTTP pushes do, and ``TCP_NOTSENT_LOWAT`` keeps what sits unsent in the
socket at about a chunk, so TRAIN never starts behind much STATE — except a push a commit waits
for, which goes whole. A header's static part crosses once per role and peer; then its digest.
A sender reads replies with a reader that stays registered on its loop; a receiver asks to be
woken for a MiB of a body at a time (``SO_RCVLOWAT``), not for every burst of segments.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable, Coroutine
from typing import Any, cast
from urllib.parse import urlsplit

from dataserver.httpserver import BearerAuth
from dataserver.protocol.errors import CorruptError, FFPlaneError, StaticHeaderUnknownError
from statestore.link_gate import LinkGate, Priority
from statestore.replicas import ReplicaStore
from statestore.shard import LocalShard
from statestore.transport._sockets import TCP_NOTSENT_LOWAT, push_socket_options
from statestore.transport.base import PeerError
from statestore.transport.bulk_wire import HEAD_SIZE, REPLY_HEAD_SIZE, BulkFrameError, BulkHead, BulkMeta, BulkReply, Op
from statestore.transport.http import HttpTransport, remember

log = logging.getLogger(__name__)

_CONNECT_S = 3.0
_NO_LOWAT = 0x7FFFFFFF  # the unsent limit lifted: the send buffer's size bounds what is queued
_SCRATCH = bytearray(256 << 10)  # where the bytes of a refused request go (one event loop: shared)
_STALL_S = 30.0  # no progress either way for this long: the peer is gone
_REPLY_BUFFER = 64 << 10  # a reply is ~100 bytes: one read takes whatever has come
_LOWAT_MAX = 1 << 20  # a receiver wakes for at least this much of a body (or all that is left of it)


class BulkTransport(HttpTransport):
    """Pushes over peers' bulk ports; pulls and shard questions over HTTP (``HttpTransport``). A
    peer that has no bulk port is pushed to over HTTP."""

    def __init__(self, gate: LinkGate, token: str | None) -> None:
        super().__init__(gate, token)
        self._token = token or ""
        self._ports: dict[str, int | None] = {}  # HTTP address → its bulk port (None: it has none)
        self._conns: dict[tuple[str, int], _Connection] = {}
        self._peers: dict[str, tuple[str, int]] = {}  # HTTP address → its bulk (host, port)
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}
        self._statics_sent: set[tuple[tuple[str, int], str, str, str]] = set()  # (peer, job, role, digest) it took

    async def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        await super().close()

    async def push(
        self,
        base: str,
        shard: LocalShard,
        source: str,
        newest: int | None,
        urgent: Callable[[], bool] = lambda: False,
        maybe_there: bool = False,
    ) -> int:
        peer = self._peers.get(base)
        if peer is None:
            port = await self._bulk_port(base)
            if port is None:
                return await super().push(base, shard, source, newest, urgent, maybe_there)
            peer = self._peers[base] = (urlsplit(base).hostname or "", port)
        async with self._locks.setdefault(peer, asyncio.Lock()):
            try:
                return await self._push(peer, shard, source, newest, urgent, maybe_there)
            except PeerError as exc:
                if exc.unreachable:  # a restarted daemon may listen elsewhere: ask again
                    self._ports.pop(base, None)
                    self._peers.pop(base, None)
                raise

    async def _bulk_port(self, base: str) -> int | None:
        if base not in self._ports:
            found = (await self._json("GET", f"{base}/v1/transfer")).get("bulk_port")
            self._ports[base] = found if isinstance(found, int) and found > 0 else None
        return self._ports[base]

    async def _push(
        self, peer: tuple[str, int], shard: LocalShard, source: str, newest: int | None, urgent: Callable[[], bool], maybe_there: bool
    ) -> int:
        digest, static, step_part = shard.header_parts()
        known = (peer, shard.job, shard.role, digest)  # the receiver has this static part (it took a push with it)

        def meta(with_static: bool) -> bytes:
            return BulkMeta(
                self._token, shard.job, shard.role, shard.step, shard.nbytes, shard.checksum, step_part, source, newest, digest,
                static if with_static else None,
            ).pack()  # fmt: skip

        raw = meta(bool(digest) and known not in self._statics_sent)
        attempt = (f"{peer[0]}:{peer[1]}", shard.job, shard.role, shard.step)
        start = 0
        if attempt in self._tried or maybe_there:  # it may hold part of it, or all: ask first
            reply = await self._exchange(peer, BulkHead(Op.PROBE, len(raw), 0, 0), raw)
            if reply.status == StaticHeaderUnknownError.status:
                raw = meta(True)
                reply = await self._exchange(peer, BulkHead(Op.PROBE, len(raw), 0, 0), raw)
            start = self._answer(reply, shard).received
        else:
            remember(self._tried, attempt)
        for _ in range(3):  # 409: it holds part of it, resume where it says; 428: it lacks the static part
            if start == shard.nbytes:
                self._tried.discard(attempt)
                self.counts.already_there += 1
                return 0
            head = BulkHead(Op.PUSH, len(raw), start, shard.nbytes - start)
            reply = await self._exchange(peer, head, raw, shard, urgent)
            if reply.status == 409:
                start = reply.received
                continue
            if reply.status == StaticHeaderUnknownError.status:
                raw = meta(True)
                continue
            self._answer(reply, shard)
            self._tried.discard(attempt)
            if digest:
                remember(self._statics_sent, known)  # forgetting costs one push with the static part
            if head.offset:
                self.counts.resumed += 1
            else:
                self.counts.in_one_request += 1
            return head.length
        raise PeerError(f"{shard.role} step {shard.step}: the receiver's offset keeps moving (another sender?); will resume", 409)

    @staticmethod
    def _answer(reply: BulkReply, shard: LocalShard) -> BulkReply:
        if reply.status != 200:
            raise PeerError(f"bulk push of {shard.role} step {shard.step} answered {reply.status}: {reply.detail}", reply.status)
        return reply

    async def _exchange(
        self,
        peer: tuple[str, int],
        head: BulkHead,
        meta: bytes,
        shard: LocalShard | None = None,
        urgent: Callable[[], bool] = lambda: False,
    ) -> BulkReply:
        """One request and its reply on the peer's connection (opened if there is none)."""
        conn = self._conns.get(peer)
        loop = asyncio.get_running_loop()
        if conn is None or not conn.usable():  # one the peer closed while idle (it restarted) is not tried
            if conn is not None:
                self._conns.pop(peer, None)
                conn.close()
            conn = await self._connect(peer)
        sock = conn.sock
        try:
            frame = head.pack() + meta
            try:  # a head and its metadata fit the socket buffer: no task, no timer, no wake-up
                sent = sock.send(frame)
            except BlockingIOError:
                sent = 0
            if sent < len(frame):
                await asyncio.wait_for(loop.sock_sendall(sock, memoryview(frame)[sent:]), _STALL_S)
            if shard is not None and head.length:
                await self._send_file(sock, shard, head.offset, head.offset + head.length, urgent)
            return await conn.reply()
        except (OSError, EOFError, asyncio.TimeoutError, BulkFrameError, ValueError) as exc:
            self._conns.pop(peer, None)
            conn.close()  # a request cut off midway leaves the connection unreadable
            raise PeerError(f"bulk push to {peer[0]}:{peer[1]} failed: {exc!r}") from exc
        except BaseException:  # cancelled, or a bug: the request's reply may still come and answer the next one
            self._conns.pop(peer, None)
            conn.close()
            raise

    async def _connect(self, peer: tuple[str, int]) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(peer[0], peer[1], type=socket.SOCK_STREAM)
            family, kind, proto, _, address = infos[0]
            sock = socket.socket(family, kind, proto)
        except OSError as exc:
            raise PeerError(f"bulk port {peer[0]}:{peer[1]}: {exc!r}", unreachable=True) from exc
        try:
            sock.setblocking(False)
            push_socket_options(sock, self._gate.config.chunk_bytes)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await asyncio.wait_for(loop.sock_connect(sock, address), _CONNECT_S)
        except (OSError, asyncio.TimeoutError) as exc:
            sock.close()
            raise PeerError(f"bulk port {peer[0]}:{peer[1]} takes no connection: {exc!r}", unreachable=True) from exc
        conn = self._conns[peer] = _Connection(loop, sock)
        return conn

    async def _send_file(self, sock: socket.socket, shard: LocalShard, start: int, end: int, urgent: Callable[[], bool]) -> None:
        """``sendfile`` from the shard's file, a gate chunk at a time — or all at once while the
        push is urgent (a commit, and so the workers' next all-reduce, waits for it: TRAIN is held
        up by this push, not the other way round), with the socket's unsent limit lifted, so the
        kernel moves it in a few calls instead of a wake-up per chunk. A primary's slot may be
        reused by a save while this runs (only for a version long superseded: a commit waits for
        its replica); the receiver then finds the checksum wrong and keeps nothing."""
        loop = asyncio.get_running_loop()
        chunk = self._gate.config.chunk_bytes
        lowat = chunk
        fd = os.open(shard.path(), os.O_RDONLY)
        try:
            pos = start
            while pos < end:
                whole = urgent()
                if lowat != (_NO_LOWAT if whole else chunk):
                    lowat = _NO_LOWAT if whole else chunk
                    sock.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, lowat)
                stop = end if whole else min(pos + chunk, end)
                await self._gate.acquire(Priority.REPLICATE, stop - pos, critical=whole or urgent)
                while pos < stop:
                    try:
                        sent = os.sendfile(sock.fileno(), fd, pos, stop - pos)
                    except BlockingIOError:
                        await _writable(loop, sock)
                        continue
                    if sent == 0:
                        raise EOFError(f"{shard.rel} ends at {pos}, before the shard's {end} bytes")
                    pos += sent
        finally:
            os.close(fd)
            if lowat != chunk:
                sock.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, chunk)


class _Connection:
    """A peer's bulk connection, its replies read by a reader that stays registered with the
    loop. (uvloop's ``sock_recv_into`` makes and drops a poll handle on every call: about ten
    syscalls a reply, twice a push.) One request is outstanding at a time (the peer's lock); a
    reply that comes early — a refusal while the body is still being sent — waits in ``_buf``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        self.sock, self._loop = sock, loop
        self._buf = bytearray()
        self._waiter: asyncio.Future[BulkReply] | None = None
        self._error: BaseException | None = None
        loop.add_reader(sock.fileno(), self._readable)

    async def reply(self) -> BulkReply:
        """The answer to the request just sent (at most ``_STALL_S`` away)."""
        self._waiter = waiter = self._loop.create_future()
        self._deliver()
        if not waiter.done() and self._error is not None:
            raise self._error
        return await asyncio.wait_for(waiter, _STALL_S)

    def _readable(self) -> None:
        try:
            data = self.sock.recv(_REPLY_BUFFER)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._fail(exc)
            return
        if not data:
            self._fail(EOFError("the peer closed the bulk connection"))
            return
        self._buf += data
        self._deliver()

    def _deliver(self) -> None:
        if self._waiter is None or self._waiter.done() or len(self._buf) < REPLY_HEAD_SIZE:
            return
        try:
            status, n = BulkReply.body_len(self._buf[:REPLY_HEAD_SIZE])
            if len(self._buf) < REPLY_HEAD_SIZE + n:
                return
            reply = BulkReply.unpack(status, self._buf[REPLY_HEAD_SIZE : REPLY_HEAD_SIZE + n])
        except Exception as exc:  # noqa: BLE001 - a reply we cannot read ends the connection, whatever is wrong with it
            self._fail(BulkFrameError(f"unreadable bulk reply: {exc!r}"), deliver=False)
            return
        del self._buf[: REPLY_HEAD_SIZE + n]
        self._waiter.set_result(reply)

    def usable(self) -> bool:
        """Whether the next request may go on this connection: not failed, not closed by the peer
        (its reader may not have run since), and nothing unasked-for waiting on it."""
        if self._error is not None or self._buf:
            return False
        try:
            self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return True  # open, and quiet
        except OSError:
            return False
        return False  # b"": the peer closed it; a byte: something nobody asked for

    def _fail(self, exc: BaseException, deliver: bool = True) -> None:
        self._error = exc
        self._loop.remove_reader(self.sock.fileno())
        if self._waiter is not None and not self._waiter.done():
            if deliver:
                self._deliver()  # a whole reply that came before the close still counts
            if not self._waiter.done():
                self._waiter.set_exception(exc)

    def close(self) -> None:
        if self.sock.fileno() >= 0:
            self._loop.remove_reader(self.sock.fileno())
        self.sock.close()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.cancel()


async def _writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_writer(sock.fileno(), wake)
    try:
        await asyncio.wait_for(ready, _STALL_S)
    finally:
        loop.remove_writer(sock.fileno())


# --- the receiver ------------------------------------------------------------------------------
class BulkServer:
    """The bulk port of a daemon: pushes land in ``replicas``. ``token``: the job's; ``budget_bytes``
    bounds what one replica may announce."""

    def __init__(self, token: str | None, replicas: ReplicaStore, budget_bytes: int) -> None:
        self.replicas, self.budget_bytes = replicas, budget_bytes
        self._auth = BearerAuth(token)
        self.port: int | None = None
        self.pushes = 0
        self.refused = 0
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Receiver(self), host or None, port, reuse_address=True)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def refusal(self, meta: BulkMeta) -> tuple[int, str] | None:
        refused = self._auth.refusal(f"Bearer {meta.token}")  # the HTTP routes' check, on the frame's token
        if refused is not None:
            return refused
        if meta.nbytes > self.budget_bytes:
            return 413, (
                f"a replica of {meta.nbytes / 2**20:.1f} MiB is larger than this daemon's whole budget "
                f"({self.budget_bytes / 2**20:.1f} MiB); raise --budget-mb on this node"
            )
        return None


class _Receiver(asyncio.BufferedProtocol):
    """One connection: a head, its metadata, then the bytes straight into the replica's mapping.
    Reading pauses while a request is decided (``begin``, the lock) and while a finished one
    is verified, so no byte of the next request arrives into the wrong buffer."""

    def __init__(self, server: BulkServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self._want = bytearray(HEAD_SIZE)  # the head or the metadata being read
        self._filled = 0
        self._head: BulkHead | None = None
        self._body: memoryview | None = None  # the replica's mapping while its bytes arrive
        self._pos = self._end = 0
        self._inc: Any = None
        self._meta: BulkMeta | None = None
        self._discard = 0  # bytes of a refused request still to read past
        self._then: BulkReply | None = None  # the answer once they are
        self._task: asyncio.Task[None] | None = None
        self._sock: Any = None  # the connection's socket, for SO_RCVLOWAT (None: not settable)
        self._lowat = 1
        self._rcvbuf = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one in all but name
        self._sock = transport.get_extra_info("socket")

    def _wake_after(self, nbytes: int, start: bool = False) -> None:
        """Be woken only once ``nbytes`` have arrived (``SO_RCVLOWAT``): a body then lands in a
        few large reads instead of one per segment burst, each a wake-up of this daemon. At most a
        quarter of the receive buffer as it is (``start``: read again): a larger mark would make
        the kernel grow the buffer and clamp the TCP window to the mark, on every link."""
        if self._sock is None:
            return
        try:
            if start:
                self._rcvbuf = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
            nbytes = max(1, min(nbytes, _LOWAT_MAX, self._rcvbuf // 4))
            if nbytes != self._lowat:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
                self._lowat = nbytes
        except OSError:  # the connection is going; or the option is refused: wake for every byte
            with contextlib.suppress(OSError):
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            self._sock, self._lowat = None, 1

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body is not None:
            return self._body[self._pos : self._end]
        if self._discard:
            return memoryview(_SCRATCH)[: min(self._discard, len(_SCRATCH))]
        return memoryview(self._want)[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._discard:
            self._discard -= nbytes
            if not self._discard and self._then is not None:
                self._reply(self._then)
            return
        if self._body is not None:
            self.server.replicas.landed(self._inc, self._body[self._pos : self._pos + nbytes])
            self._pos += nbytes
            self._wake_after(self._end - self._pos)
            if self._pos == self._end:
                self._decide(self._complete())
            return
        self._filled += nbytes
        if self._filled < len(self._want):
            return
        if self._head is None:
            try:
                self._head = BulkHead.unpack(self._want)
            except BulkFrameError as exc:
                self._refuse(400, str(exc))
                return
            self._want, self._filled = bytearray(self._head.meta_len), 0
            if self._head.meta_len:
                return
        self._decide(self._start(bytes(self._want)))

    def _decide(self, work: Coroutine[Any, Any, None]) -> None:
        assert self.transport is not None
        self.transport.pause_reading()
        self._task = asyncio.ensure_future(self._guarded(work))

    async def _guarded(self, work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        except Exception:  # noqa: BLE001 - a bug must cost this connection, not the transfer's lock
            log.exception("bulk receive failed; connection closed")
            self._release()
            self._refuse(500, "the receiving daemon failed; see its log")

    async def _start(self, raw: bytes) -> None:
        head = self._head
        assert head is not None and self.transport is not None
        try:
            meta = BulkMeta.unpack(raw)
        except ValueError as exc:
            self._refuse(422, str(exc))
            return
        refused = self.server.refusal(meta)
        if refused is not None:  # nothing from a peer without the token is read on
            self._refuse(*refused)
            return
        if head.offset + head.length > meta.nbytes:
            self._skip(BulkReply(400, detail=f"bytes {head.offset}..{head.offset + head.length} run past the shard's {meta.nbytes}"))
            return
        store = self.server.replicas
        try:
            held = store.begin(
                meta.job, meta.role, meta.step, meta.nbytes, meta.checksum, meta.header, meta.source,
                static=meta.static, static_header=meta.static_header,
            )  # fmt: skip
        except FFPlaneError as exc:
            self._skip(BulkReply(413 if exc.status == 507 else exc.status, detail=str(exc)))
            return
        if head.op == Op.PROBE:
            self._reply(BulkReply(200, held))
            return
        if held != head.offset:
            self._skip(BulkReply(409, held, detail=f"{held} bytes of {meta.role} step {meta.step} are here; resume from there"))
            return
        try:
            if store.sink_mapped(meta.job, meta.role, meta.step):  # a reused file: mapped already
                inc, body = store.sink(meta.job, meta.role, meta.step)
            else:  # a new file's pages are allocated as it is mapped: off the loop
                inc, body = await asyncio.to_thread(store.sink, meta.job, meta.role, meta.step)
            await inc.lock.acquire()
        except FFPlaneError as exc:
            self._skip(BulkReply(exc.status, detail=str(exc)))
            return
        if self.transport.is_closing():  # the sender went while this waited: the lock must not stay held
            inc.lock.release()
            return
        if inc.received != head.offset:  # another transfer moved it meanwhile
            inc.lock.release()
            self._skip(BulkReply(409, inc.received, detail=f"{inc.received} bytes of {meta.role} step {meta.step} are here; resume"))
            return
        self._inc, self._body, self._pos, self._end, self._meta = inc, body, head.offset, head.offset + head.length, meta
        self._wake_after(head.length, start=True)
        if not head.length:
            await self._complete()
            return
        self.transport.resume_reading()

    async def _complete(self) -> None:
        meta, end = self._meta, self._end
        assert meta is not None
        self._release()
        reply = BulkReply(200, end)
        if end == meta.nbytes:
            try:
                r = await self.server.replicas.finish(meta.job, meta.role, meta.step, meta.newest)
                reply = BulkReply(200, end, r.checksum)
                self.server.pushes += 1
            except CorruptError as exc:
                reply = BulkReply(422, 0, detail=str(exc))
            except FFPlaneError as exc:
                reply = BulkReply(exc.status, 0, detail=str(exc))
        self._reply(reply)

    def _release(self) -> None:
        if self._inc is not None:
            self._inc.lock.release()
        self._inc, self._body = None, None

    def _reply(self, reply: BulkReply) -> None:
        """Answer, and read the next request's head."""
        assert self.transport is not None
        if self.transport.is_closing():
            return
        self.transport.write(reply.pack())
        self._head, self._want, self._filled, self._then = None, bytearray(HEAD_SIZE), 0, None
        self.transport.resume_reading()

    def _skip(self, reply: BulkReply) -> None:
        """A refused request from a peer with the token: read past its bytes, then answer (the
        connection stays usable, and the sender reads the answer instead of a reset)."""
        assert self.transport is not None and self._head is not None
        self.server.refused += 1
        if self.transport.is_closing():
            return
        self._discard = self._head.length
        if not self._discard:
            self._reply(reply)
            return
        self._then = reply
        self.transport.resume_reading()

    def _refuse(self, status: int, detail: str) -> None:
        """Answer and close: nothing more is read from a peer without the token, or one whose
        frames are not ours."""
        assert self.transport is not None
        self.server.refused += 1
        if not self.transport.is_closing():
            self.transport.write(BulkReply(status, detail=detail).pack())
            self.transport.close()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()  # what landed counts: the sender resumes after it
