"""The sending side of the bulk channel reads a peer's replies with a reader kept registered on its
loop (``statestore.transport.bulk._Connection``): a reply in pieces, one that came before it was
asked for (a refusal while the body was still going out), one followed by the peer's close, and a
close with no reply. The peer here is a plain socket speaking ``bulk_wire``, on the daemon's loop (uvloop)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import pytest
import uvloop

from statestore.transport.bulk import _Connection
from statestore.transport.bulk_wire import BulkFrameError, BulkReply


def _on_uvloop(body: Callable[[_Connection, socket.socket], Awaitable[None]]) -> None:
    async def main() -> None:
        ours, peer = socket.socketpair()
        ours.setblocking(False)
        conn = _Connection(asyncio.get_running_loop(), ours)
        try:
            await body(conn, peer)
        finally:
            conn.close()
            peer.close()

    uvloop.run(main())


def test_a_reply_in_pieces_and_two_read_at_once_arrive_whole_and_in_order() -> None:
    async def body(conn: _Connection, peer: socket.socket) -> None:
        first = BulkReply(200, 4096, "0123abcd").pack()
        peer.sendall(first[:3])
        waiting = asyncio.ensure_future(conn.reply())
        await asyncio.sleep(0.05)
        assert not waiting.done()  # half a head is no reply
        peer.sendall(first[3:])
        assert await waiting == BulkReply(200, 4096, "0123abcd")
        # two answers read at once: each goes to its own request
        peer.sendall(BulkReply(401, detail="no token").pack() + BulkReply(200, 7).pack())
        await asyncio.sleep(0.05)
        assert await conn.reply() == BulkReply(401, detail="no token")
        assert await conn.reply() == BulkReply(200, 7)
        assert conn.usable()

    _on_uvloop(body)


def test_a_reply_before_the_peer_closes_counts_and_then_the_connection_is_not_reused() -> None:
    async def body(conn: _Connection, peer: socket.socket) -> None:
        assert conn.usable()
        peer.sendall(BulkReply(413, detail="too large").pack())
        peer.shutdown(socket.SHUT_WR)
        await asyncio.sleep(0.05)
        assert not conn.usable()  # the next request opens a new connection
        assert await conn.reply() == BulkReply(413, detail="too large")
        with pytest.raises(EOFError):
            await conn.reply()

    _on_uvloop(body)


def test_a_close_while_a_reply_is_awaited_raises_instead_of_waiting() -> None:
    async def body(conn: _Connection, peer: socket.socket) -> None:
        waiting = asyncio.ensure_future(conn.reply())
        await asyncio.sleep(0.05)
        peer.sendall(BulkReply(200, 1).pack()[:4])  # half a reply, then the peer dies
        peer.shutdown(socket.SHUT_WR)
        with pytest.raises(EOFError):
            await asyncio.wait_for(waiting, 5)

    _on_uvloop(body)


def test_a_connection_the_peer_closed_is_not_reused_even_before_its_reader_ran() -> None:
    async def body(conn: _Connection, peer: socket.socket) -> None:
        peer.shutdown(socket.SHUT_WR)  # no loop turn between this and the check
        assert not conn.usable()

    _on_uvloop(body)


def test_an_unreadable_reply_fails_the_request_instead_of_leaving_it_waiting() -> None:
    async def body(conn: _Connection, peer: socket.socket) -> None:
        waiting = asyncio.ensure_future(conn.reply())
        body = b"[1, 2]"  # JSON, but not a reply
        peer.sendall(BulkReply(200).pack()[:2] + len(body).to_bytes(4, "little") + body)
        with pytest.raises(BulkFrameError):
            await asyncio.wait_for(waiting, 5)
        assert not conn.usable()

    _on_uvloop(body)
