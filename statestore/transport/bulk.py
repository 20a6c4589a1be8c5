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
A sender opens a connection with ``HELLO`` (the token) and reads replies with a reader that stays
registered on its loop; a refusal may come while the body is still going out, and then the rest
is not sent. The receiver is ``bulk_server``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

from ffplane_contract.errors import StaticHeaderUnknownError
from statestore.link_gate import LinkGate, Priority
from statestore.shard import LocalShard
from statestore.transport._sockets import TCP_NOTSENT_LOWAT, push_socket_options
from statestore.transport.base import PeerError
from statestore.transport.bulk_server import BulkServer, keepalive
from statestore.transport.bulk_wire import REPLY_HEAD_SIZE, BulkFrameError, BulkHead, BulkMeta, BulkReply, Op
from statestore.transport.http import HttpTransport, remember

__all__ = ["BulkServer", "BulkTransport"]

log = logging.getLogger(__name__)

_CONNECT_S = 3.0
_NO_LOWAT = 0x7FFFFFFF  # the unsent limit lifted: the send buffer's size bounds what is queued
_STALL_S = 30.0  # no progress either way for this long: the peer is gone
_REPLY_BUFFER = 64 << 10  # a reply is ~100 bytes: one read takes whatever has come


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
                shard.job, shard.role, shard.step, shard.nbytes, shard.checksum, step_part, source, newest, digest,
                static if with_static else None, shard.header_digest,
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
                done = await self._send_file(conn, shard, head.offset, head.offset + head.length, urgent)
                if not done:  # answered before the last byte (a refusal): the rest is not sent
                    self._conns.pop(peer, None)
                    reply = await conn.reply()
                    conn.close()  # the receiver reads past the bytes announced: this connection cannot carry another
                    return reply
            return await conn.reply()
        except (OSError, EOFError, asyncio.TimeoutError, BulkFrameError, ValueError) as exc:
            self._conns.pop(peer, None)
            early = conn.early_reply()  # the receiver said why before it closed: that is the answer
            conn.close()  # a request cut off midway leaves the connection unreadable
            if early is not None:
                return early
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
            keepalive(sock)
            await asyncio.wait_for(loop.sock_connect(sock, address), _CONNECT_S)
        except (OSError, asyncio.TimeoutError) as exc:
            sock.close()
            raise PeerError(f"bulk port {peer[0]}:{peer[1]} takes no connection: {exc!r}", unreachable=True) from exc
        conn = _Connection(loop, sock)
        try:  # the token first: the receiver reads nothing else from a connection until it has it
            await asyncio.wait_for(loop.sock_sendall(sock, BulkHead.hello(self._token)), _CONNECT_S)
            reply = await conn.reply()
        except (OSError, EOFError, asyncio.TimeoutError, BulkFrameError, ValueError) as exc:
            conn.close()
            raise PeerError(f"bulk port {peer[0]}:{peer[1]} did not take the token: {exc!r}") from exc
        if reply.status != 200:
            conn.close()
            raise PeerError(f"bulk port {peer[0]}:{peer[1]} refused the connection ({reply.status}): {reply.detail}", reply.status)
        self._conns[peer] = conn
        return conn

    async def _send_file(self, conn: _Connection, shard: LocalShard, start: int, end: int, urgent: Callable[[], bool]) -> bool:
        """``sendfile`` from the shard's file, a gate chunk at a time — or all at once while the
        push is urgent (a commit, and so the workers' next all-reduce, waits for it: TRAIN is held
        up by this push, not the other way round), with the socket's unsent limit lifted, so the
        kernel moves it in a few calls instead of a wake-up per chunk. A primary's slot may be
        reused by a save while this runs (only for a version long superseded: a commit waits for
        its replica); the receiver then finds the checksum wrong and keeps nothing. False: the
        receiver answered before the last byte (it refused the push), and the rest was not sent."""
        loop = asyncio.get_running_loop()
        sock = conn.sock
        chunk = self._gate.config.chunk_bytes
        lowat = chunk
        fd = os.open(shard.path(), os.O_RDONLY)
        try:
            pos = start
            while pos < end:
                if conn.answered():
                    return False
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
            return True
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

    def early_reply(self) -> BulkReply | None:
        """A whole reply that has come and was not asked for yet, if any (read without waiting)."""
        if self._error is None:
            self._readable()
        if len(self._buf) < REPLY_HEAD_SIZE:
            return None
        try:
            status, n = BulkReply.body_len(self._buf[:REPLY_HEAD_SIZE])
            if len(self._buf) < REPLY_HEAD_SIZE + n:
                return None
            return BulkReply.unpack(status, self._buf[REPLY_HEAD_SIZE : REPLY_HEAD_SIZE + n])
        except Exception:  # noqa: BLE001 - unreadable: no answer
            return None

    def answered(self) -> bool:
        """Whether a reply (or the peer's close) has come before it was asked for."""
        return bool(self._buf) or self._error is not None

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
