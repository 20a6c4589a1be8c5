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
from statestore.transport.bulk_wire import BulkReply


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


def test_a_reply_in_pieces_and_one_that_came_early_arrive_whole_and_in_order() -> None:
    async def body(conn: _Connection, peer: socket.socket) -> None:
        first = BulkReply(200, 4096, "0123abcd").pack()
        peer.sendall(first[:3])
        waiting = asyncio.ensure_future(conn.reply())
        await asyncio.sleep(0.05)
        assert not waiting.done()  # half a head is no reply
        peer.sendall(first[3:])
        assert await waiting == BulkReply(200, 4096, "0123abcd")
        # a refusal sent while the request's body was still going out, and the next request's answer
        peer.sendall(BulkReply(401, detail="no token").pack() + BulkReply(200, 7).pack())
        await asyncio.sleep(0.05)
        assert await conn.reply() == BulkReply(401, detail="no token")
        assert await conn.reply() == BulkReply(200, 7)
        assert not conn.broken

    _on_uvloop(body)


def test_a_reply_before_the_peer_closes_counts_and_then_the_connection_is_broken() -> None:
    async def body(conn: _Connection, peer: socket.socket) -> None:
        peer.sendall(BulkReply(413, detail="too large").pack())
        peer.shutdown(socket.SHUT_WR)
        await asyncio.sleep(0.05)
        assert conn.broken  # the next request opens a new connection
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
