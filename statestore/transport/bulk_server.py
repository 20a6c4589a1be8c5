"""The receiving end of the bulk channel (``statestore.transport.bulk``): a daemon's bulk port,
where replica pushes land straight in the replica's mapped file.

The port is reachable by whoever reaches the node, so what a peer can cost it is bounded before
the peer has shown the token, in one place (``_Receiver``'s states):

- **before the token** a connection may send one ``HELLO`` frame of at most ``HELLO_LIMIT`` bytes,
  within ``AUTH_S`` of connecting however slowly it sends; nothing else is read or allocated. At
  most ``PREAUTH_CONNECTIONS`` such connections are held: a new one closes the oldest, so a flood
  of idle connections cannot keep a daemon with the token out (it authenticates in one round trip);
- **after it**, at most ``AUTH_CONNECTIONS`` connections; a request's metadata buffer grows with
  the bytes that arrived (not with what the head announced); a request that makes no progress for
  ``STALL_S`` and a connection idle between requests for ``IDLE_S`` are closed; TCP keepalive
  finds peers that vanished without a word;
- **a transfer's lock** is never waited for: a second sender of the same shard takes over from a
  first that has stalled (what landed counts; it resumes from there) and is told to come back while
  the first still makes progress;
- **a refusal is answered at once**, before the refused bytes are read past, so the sender stops
  sending and hears why (a full tmpfs: ``CapacityError``, not a reset).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import OrderedDict
from collections.abc import Coroutine
from typing import Any, cast

from ffplane_contract.errors import CorruptError, FFPlaneError
from ffplane_runtime.httpserver import BearerAuth
from statestore.replicas import ReplicaStore
from statestore.transport.bulk_wire import HEAD_SIZE, BulkFrameError, BulkHead, BulkMeta, BulkReply, Op

log = logging.getLogger(__name__)

AUTH_S = 5.0  # a new connection's whole HELLO must arrive within this
IDLE_S = 300.0  # an authenticated connection with no request under way (the sender reconnects)
STALL_S = 30.0  # a request under way that moves no byte for this long: the peer is gone
TAKEOVER_S = 2.0  # a transfer whose sender moved no byte for this long may be taken over by another
PREAUTH_CONNECTIONS = 32  # unauthenticated connections held at once; a new one closes the oldest
AUTH_CONNECTIONS = 256  # a ring has a few senders per node; beyond this, new ones are refused
KEEPALIVE = (30, 10, 3)  # idle seconds before probing, seconds between probes, probes before giving up
_PIECE = 256 << 10  # metadata and refused bytes are read in pieces of this (one loop: one scratch buffer)
_SCRATCH = bytearray(_PIECE)
_LOWAT_MAX = 1 << 20  # a receiver wakes for at least this much of a body (or all that is left of it)


class BulkServer:
    """The bulk port of a daemon: pushes land in ``replicas``. ``token``: the job's; the whole
    budget the replicas share bounds what one replica may announce."""

    def __init__(self, token: str | None, replicas: ReplicaStore) -> None:
        self.replicas = replicas
        self.auth = BearerAuth(token)
        self.port: int | None = None
        self.pushes = 0
        self.refused = 0  # requests answered with an error
        self.closed: dict[str, int] = {"auth_timeout": 0, "idle": 0, "stalled": 0, "taken_over": 0, "evicted": 0, "over_cap": 0}
        self.preauth: OrderedDict[_Receiver, None] = OrderedDict()  # oldest first
        self.authed: set[_Receiver] = set()
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Receiver(self), host or None, port, reuse_address=True, backlog=128)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for conn in [*self.preauth, *self.authed]:
            conn.expire("")

    def describe(self) -> dict[str, Any]:
        return {
            "bulk_port": self.port,
            "bulk_pushes_received": self.pushes,
            "bulk_refused": self.refused,
            "bulk_connections": {"authenticated": len(self.authed), "unauthenticated": len(self.preauth)},
            "bulk_closed": dict(self.closed),
        }

    def admit(self, conn: _Receiver) -> None:
        """A new connection: held as unauthenticated, closing the oldest such one if too many are."""
        if len(self.preauth) >= PREAUTH_CONNECTIONS:
            next(iter(self.preauth)).expire("evicted")
        self.preauth[conn] = None

    def authenticated(self, conn: _Receiver) -> bool:
        self.preauth.pop(conn, None)
        if len(self.authed) >= AUTH_CONNECTIONS:
            self.closed["over_cap"] += 1
            return False
        self.authed.add(conn)
        return True

    def gone(self, conn: _Receiver) -> None:
        self.preauth.pop(conn, None)
        self.authed.discard(conn)

    def refusal(self, meta: BulkMeta) -> tuple[int, str] | None:
        total = self.replicas.budget.total
        if meta.nbytes > total:
            return 413, (
                f"a replica of {meta.nbytes / 2**20:.1f} MiB is larger than this daemon's whole budget "
                f"({total / 2**20:.1f} MiB); raise --budget-mb on this node"
            )
        return None


def keepalive(sock: Any) -> None:
    """TCP keepalive on a bulk connection, either end: a peer that vanished without a word is found."""
    idle, interval, count = KEEPALIVE
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)


class _Receiver(asyncio.BufferedProtocol):
    """One connection: ``HELLO``, then requests: a head, its metadata, then the bytes straight into
    the replica's mapping. Reading pauses while a request is decided (``begin``, the lock) and
    while a finished one is verified, so no byte of the next request arrives into the wrong
    buffer. One timer bounds every wait on the peer (``_check``)."""

    def __init__(self, server: BulkServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()  # made by the server's protocol factory, on its loop
        self._authed = False
        self._head_buf = bytearray(HEAD_SIZE)
        self._filled = 0  # bytes of the head, or of the metadata, read so far
        self._head: BulkHead | None = None
        self._meta_buf: bytearray | None = None  # the metadata, as it arrives
        self._body: memoryview | None = None  # the replica's mapping while its bytes arrive
        self._pos = self._end = 0
        self._inc: Any = None
        self._meta: BulkMeta | None = None
        self._discard = 0  # bytes of a refused request still to read past (its answer has gone)
        self._task: asyncio.Task[None] | None = None
        self._sock: Any = None  # the connection's socket, for SO_RCVLOWAT (None: not settable)
        self._lowat = 1
        self._rcvbuf = 0
        self._since = self._loop.time()  # the last byte that arrived (or the connection, or the last answer)
        self._opened = self._since
        self._timer: asyncio.TimerHandle | None = None

    # --- the connection's lifetime ---------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one in all but name
        self._sock = transport.get_extra_info("socket")
        keepalive(self._sock)
        self.server.admit(self)
        self._timer = self._loop.call_later(AUTH_S, self._check)

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()  # what landed counts: the sender resumes after it
        self.server.gone(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def eof_received(self) -> bool:
        return False

    def _limit(self) -> tuple[str, float] | None:
        """What the peer is being waited for now, and the most it may take (from ``_since``, or
        from the connection for a HELLO); None while this daemon is the one working."""
        if not self._authed:
            return "auth_timeout", AUTH_S
        if self._task is not None and not self._task.done():
            return None
        if self._head is None and not self._filled and not self._discard:
            return "idle", IDLE_S
        return "stalled", STALL_S

    def _check(self) -> None:
        self._timer = None
        if self.transport is None or self.transport.is_closing():
            return
        limit = self._limit()
        now = self._loop.time()
        if limit is None:
            left = STALL_S
        else:
            why, seconds = limit
            left = (self._opened if why == "auth_timeout" else self._since) + seconds - now
            if left <= 0:
                self.expire(why)
                return
        self._timer = self._loop.call_later(max(left, 0.05), self._check)

    def expire(self, why: str) -> None:
        """Close the connection now (``why``: the count it goes under; "" for none), releasing
        whatever transfer it holds; what landed counts."""
        if why:
            self.server.closed[why] = self.server.closed.get(why, 0) + 1
            log.debug("bulk connection closed", extra={"reason": why, "peer": self._peer()})
        self.server.gone(self)
        self._release()
        if self.transport is not None:
            self.transport.abort()

    def _peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "?"

    # --- reading -----------------------------------------------------------------------------
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
            return memoryview(_SCRATCH)[: min(self._discard, _PIECE)]
        if self._meta_buf is not None:  # grows as pieces arrive: an announcement costs nothing
            assert self._head is not None
            return memoryview(_SCRATCH)[: min(self._head.meta_len - self._filled, _PIECE)]
        return memoryview(self._head_buf)[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self._since = self._loop.time()
        if self._discard:
            self._discard -= nbytes
            if not self._discard:
                self._next_request()
            return
        if self._body is not None:
            self.server.replicas.landed(self._inc, self._body[self._pos : self._pos + nbytes])
            self._pos += nbytes
            self._wake_after(self._end - self._pos)
            if self._pos == self._end:
                self._decide(self._complete())
            return
        if self._meta_buf is not None:
            self._meta_buf += _SCRATCH[:nbytes]
            self._filled += nbytes
        else:
            self._filled += nbytes
            if self._filled < HEAD_SIZE:
                return
            if not self._read_head():
                return
        assert self._head is not None
        if self._filled < self._head.meta_len:
            return
        raw = bytes(self._meta_buf or b"")
        self._meta_buf = None
        if self._head.op == Op.HELLO:
            self._hello(raw)
        else:
            self._decide(self._start(raw))

    def _read_head(self) -> bool:
        """The head is in: check it; read its metadata next (False: the connection is refused)."""
        try:
            self._head = head = BulkHead.unpack(self._head_buf)
        except BulkFrameError as exc:
            self._refuse(400, str(exc))
            return False
        if not self._authed and head.op != Op.HELLO:
            self._refuse(401, "authenticate first: a bulk connection opens with HELLO and the job token")
            return False
        self._filled = 0
        self._meta_buf = bytearray()
        return True

    def _hello(self, token: bytes) -> None:
        refused = self.server.auth.refusal(f"Bearer {token.decode('utf-8', 'replace')}")
        if refused is not None:
            self._refuse(*refused)
            return
        if not self._authed:
            self._authed = True
            if not self.server.authenticated(self):
                self._refuse(503, f"this daemon holds {AUTH_CONNECTIONS} bulk connections already; try again")
                return
        self._answer(BulkReply(200))
        self._next_request()

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

    # --- deciding a request --------------------------------------------------------------------
    async def _start(self, raw: bytes) -> None:
        head = self._head
        assert head is not None and self.transport is not None
        try:
            meta = BulkMeta.unpack(raw)
        except ValueError as exc:
            self._refuse(422, str(exc))
            return
        refused = self.server.refusal(meta)
        if refused is not None:
            self._skip(BulkReply(refused[0], detail=refused[1]))
            return
        if head.offset + head.length > meta.nbytes:
            self._skip(BulkReply(400, detail=f"bytes {head.offset}..{head.offset + head.length} run past the shard's {meta.nbytes}"))
            return
        store = self.server.replicas
        try:
            held = store.begin(
                meta.job, meta.role, meta.step, meta.nbytes, meta.checksum, meta.header, meta.source,
                static=meta.static, static_header=meta.static_header, header_digest=meta.header_digest,
            )  # fmt: skip
        except FFPlaneError as exc:
            self._skip(BulkReply(413 if exc.status == 507 else exc.status, detail=str(exc)))
            return
        if head.op == Op.PROBE:
            self._answer(BulkReply(200, held))
            self._next_request()
            return
        if held != head.offset:
            self._skip(BulkReply(409, held, detail=f"{held} bytes of {meta.role} step {meta.step} are here; resume from there"))
            return
        try:
            if store.sink_mapped(meta.job, meta.role, meta.step):  # a reused file: mapped already
                inc, body = store.sink(meta.job, meta.role, meta.step)
            else:  # a new file's pages are allocated as it is mapped: off the loop
                inc, body = await asyncio.to_thread(store.sink, meta.job, meta.role, meta.step)
        except FFPlaneError as exc:
            self._skip(BulkReply(413 if exc.status == 507 else exc.status, detail=str(exc)))
            return
        if not await self._take(inc, meta):
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
        self._since = self._loop.time()
        self.transport.resume_reading()

    async def _take(self, inc: Any, meta: BulkMeta) -> bool:
        """The transfer's lock, never waited for behind a sender that may be gone: taken from a
        holder on this port that moved nothing for ``TAKEOVER_S`` (closed; what it landed
        counts), else refused (the sender is told to come back). A free lock is taken without a
        wait (an HTTP receive queued for it goes first)."""
        holder = inc.owner
        if inc.lock.locked():
            if isinstance(holder, _Receiver) and self._loop.time() - holder._since > TAKEOVER_S:
                holder.expire("taken_over")
            else:
                self._skip(
                    BulkReply(409, inc.received, detail=f"another transfer of {meta.role} step {meta.step} is under way here; try again")
                )
                return False
        await inc.lock.acquire()
        inc.owner = self
        return True

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
        if reply.status != 200:
            self.server.refused += 1
        self._answer(reply)
        self._next_request()

    def _release(self) -> None:
        if self._inc is not None:
            self._inc.owner = None
            self._inc.lock.release()
        self._inc, self._body = None, None

    # --- answering -----------------------------------------------------------------------------
    def _answer(self, reply: BulkReply) -> None:
        assert self.transport is not None
        if not self.transport.is_closing():
            self.transport.write(reply.pack())

    def _next_request(self) -> None:
        """Read the next request's head."""
        assert self.transport is not None
        self._head, self._meta_buf, self._filled, self._task = None, None, 0, None
        self._since = self._loop.time()
        if not self.transport.is_closing():
            self.transport.resume_reading()

    def _skip(self, reply: BulkReply) -> None:
        """A refused request from a peer with the token: answer now (the sender stops sending and
        reads why), then read past whatever of its bytes it has sent (the connection stays usable)."""
        assert self.transport is not None and self._head is not None
        self.server.refused += 1
        log.info("bulk request refused", extra={"status": reply.status, "reason": reply.detail, "peer": self._peer()})
        self._answer(reply)
        self._discard = self._head.length
        if not self._discard:
            self._next_request()
            return
        self._since = self._loop.time()
        self.transport.resume_reading()

    def _refuse(self, status: int, detail: str) -> None:
        """Answer and close: nothing more is read from a peer without the token, or one whose
        frames are not ours."""
        assert self.transport is not None
        self.server.refused += 1
        if not self.transport.is_closing():
            self.transport.write(BulkReply(status, detail=detail).pack())
            self.transport.close()
