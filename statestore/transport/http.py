"""The HTTP transport: the client of shard moves over the daemons' HTTP API (``HttpTransport``);
the peer routes it calls, which every daemon serves, are ``statestore.routes.peer``.

Both directions move chunks of ``GateConfig.chunk_bytes`` through the node's link gate, with the
job's token: pushes to ``/v1/replicas/...``, reads from ``/v1/state/...``. A shard's first push is
one request (metadata, bytes, commit: ``PUT .../whole``, body as ``_body`` lays it out); a retry
resumes at the offset the receiver reports (``begin``, then ``PUT`` from there and ``commit``), so
an interrupted transfer does not start over; the receiver verifies the whole-shard checksum before
the replica counts.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp

from ffplane_contract.auth import bearer
from ffplane_contract.errors import CorruptError, FFPlaneError, TransferOrderError
from ffplane_contract.shard import header_intact
from statestore.link_gate import LinkGate, Priority
from statestore.replicas import Replica, ReplicaStore
from statestore.shard import LocalShard
from statestore.transport._body import meta_prefix, read_meta_prefix
from statestore.transport._sockets import push_socket_options
from statestore.transport.base import PeerError, RemoteShard, Transport

__all__ = ["HttpTransport", "meta_prefix", "read_meta_prefix", "remember"]

_KEPT = 4096


def remember(kept: set[Any], item: Any) -> None:
    """Add ``item`` to a bounded memory of what went before: past ``_KEPT`` it starts afresh
    (forgetting only ever costs a retry the first-attempt path)."""
    if len(kept) > _KEPT:
        kept.clear()
    kept.add(item)


class HttpTransport(Transport):
    """The client: chunked reads from, and chunked pushes to, another daemon's peer routes."""

    def __init__(self, gate: LinkGate, token: str | None) -> None:
        super().__init__()
        self._gate = gate
        self._headers = bearer(token)
        self._session: aiohttp.ClientSession | None = None
        self._push_session: aiohttp.ClientSession | None = None  # bounded send queue, for pushes
        self._tried: set[tuple[str, str, str, int]] = set()  # shards whose single-request push did not complete

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=3, sock_read=30)
        self._session = aiohttp.ClientSession(timeout=timeout)
        lowat = self._gate.config.chunk_bytes

        def small_queue(info: Any) -> socket.socket:
            sock = socket.socket(family=info[0], type=info[1], proto=info[2])
            push_socket_options(sock, lowat)
            return sock

        self._push_session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(socket_factory=small_queue))

    async def close(self) -> None:
        for session in (self._session, self._push_session):
            if session is not None:
                await session.close()

    async def _json(self, method: str, url: str, session: aiohttp.ClientSession | None = None, **kw: Any) -> dict[str, Any]:
        session = session or self._session
        assert session is not None
        try:
            async with session.request(method, url, headers=self._headers, **kw) as resp:
                if resp.status != 200:
                    raise PeerError(f"{method} {url} answered {resp.status}: {(await resp.text())[:300]}", resp.status)
                result: dict[str, Any] = await resp.json()
                return result
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise PeerError(
                f"{method} {url} failed: {exc!r}", unreachable=isinstance(exc, (aiohttp.ClientConnectorError, asyncio.TimeoutError))
            ) from exc

    async def push(
        self,
        base: str,
        shard: LocalShard,
        source: str,
        newest: int | None,
        urgent: Callable[[], bool] = lambda: False,
        maybe_there: bool = False,
    ) -> int:
        """A shard's first attempt is one request carrying its metadata, its bytes and the commit
        (``PUT .../whole``): three requests per shard per step were most of a daemon's HTTP
        work in a job with short steps. A retry, a receiver that already holds part of the
        shard, or one that ``maybe_there`` (a version pushed before, sent again after a ring
        change) goes through ``begin`` and resumes from the offset it answers — nothing more
        if the whole shard is there.
        """
        assert self._session is not None
        url = f"{base}/v1/replicas/{shard.job}/{shard.role}/{shard.step}"
        meta = {
            "nbytes": shard.nbytes,
            "checksum": shard.checksum,
            "header": shard.header,
            "source": source,
            "header_digest": shard.header_digest,
        }
        attempt = (base, shard.job, shard.role, shard.step)
        staged: memoryview | None = None
        start: int | None = None  # what the receiver holds; not asked before a first attempt
        if attempt in self._tried or maybe_there:
            start = await self._begin(url, meta)  # asked before staging: it may hold all of it
        else:
            staged = await self._staged(shard)
            remember(self._tried, attempt)
            try:
                await self._json(
                    "PUT",
                    f"{url}/whole",
                    params={} if newest is None else {"newest": str(newest)},
                    session=self._push_session,
                    data=self._gated(staged, 0, urgent, prefix=meta_prefix(meta)),
                )
            except PeerError as exc:
                if not exc.conflict:
                    raise  # retried later through begin, from what arrived
                start = await self._begin(url, meta)  # 409: the receiver holds part of it already
            else:
                self._tried.discard(attempt)
                self.counts.in_one_request += 1
                return shard.nbytes
        if start == shard.nbytes:  # complete and verified there: its commit has been made
            self._tried.discard(attempt)
            self.counts.already_there += 1
            return 0
        if staged is None:
            staged = await self._staged(shard)
        offset = int(
            (
                await self._json(
                    "PUT", url, params={"offset": str(start)}, session=self._push_session, data=self._gated(staged, start, urgent)
                )
            )["received"]
        )
        if offset != shard.nbytes:
            raise PeerError(f"{shard.role} step {shard.step}: the receiver has {offset} of {shard.nbytes} bytes; will resume", 502)
        await self._json("POST", f"{url}/commit", params={} if newest is None else {"newest": str(newest)})
        self._tried.discard(attempt)
        self.counts.resumed += 1
        return offset - start

    async def _begin(self, url: str, meta: dict[str, Any]) -> int:
        """Announce a shard to the receiver; the offset it holds it up to."""
        return int((await self._json("POST", f"{url}/begin", json=meta))["received"])

    @staticmethod
    async def _staged(shard: LocalShard) -> memoryview:
        """A private copy of ``shard`` (memcpy speed): a save may reuse the slot two commits
        later, long before a slow link has carried the whole shard; the copy keeps every pushed
        byte useful and saves never wait for the network."""
        staged = memoryview(await asyncio.to_thread(bytes, shard.view()))
        if not shard.current():
            raise PeerError(f"{shard.role} step {shard.step} was replaced here while being staged", 409)
        return staged

    async def _gated(
        self, view: memoryview, start: int, urgent: Callable[[], bool], prefix: bytes = b""
    ) -> AsyncIterator[memoryview | bytes]:
        """One request's body, fed a chunk at a time as the gate allows; the connection's small
        unsent-bytes limit keeps what is queued when TRAIN starts to about one chunk."""
        if prefix:
            yield prefix
        chunk = self._gate.config.chunk_bytes
        pos = start
        while pos < len(view):
            n = min(chunk, len(view) - pos)
            await self._gate.acquire(Priority.REPLICATE, n, critical=urgent)
            yield view[pos : pos + n]
            pos += n

    async def shard_meta(self, base: str, job: str, role: str, step: int) -> RemoteShard:
        meta = await self._json("GET", f"{base}/v1/state/{job}/{role}/{step}")
        return RemoteShard(
            int(meta["nbytes"]), str(meta["checksum"]), dict(meta["header"]), str(meta.get("kind", "")), str(meta.get("header_digest", ""))
        )

    async def pull(self, base: str, replicas: ReplicaStore, job: str, role: str, step: int, source: str) -> Replica:
        assert self._session is not None
        url = f"{base}/v1/state/{job}/{role}/{step}"
        held = await self.shard_meta(base, job, role, step)
        nbytes, digest, header = held.nbytes, held.checksum, held.header
        if not header_intact(header, held.header_digest):  # the holder's header changed at rest: not a copy to restore from
            raise PeerError(f"{role} step {step} on {base} has a header that does not match its digest", CorruptError.status)
        offset = replicas.begin(job, role, step, nbytes, digest, header, source, kind="pulled", header_digest=held.header_digest)
        chunk = self._gate.config.chunk_bytes
        conflicts = 0
        while offset < nbytes:
            n = min(chunk, nbytes - offset)
            await self._gate.acquire(Priority.NEXT_BATCH, n)  # a worker is waiting for it
            try:
                async with self._session.get(
                    f"{url}/shard", params={"offset": str(offset), "length": str(n)}, headers=self._headers
                ) as resp:
                    if resp.status != 200:
                        raise PeerError(f"GET {url}/shard answered {resp.status}: {(await resp.text())[:300]}", resp.status)
                    data = await resp.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise PeerError(f"GET {url}/shard failed: {exc!r}") from exc
            try:
                offset = await replicas.write(job, role, step, offset, data)
            except FFPlaneError as exc:
                conflicts += 1
                if not isinstance(exc, TransferOrderError) or conflicts > 16:
                    raise
                # The holder is also pushing this shard here (it is our ring predecessor and
                # re-replicates after the failure): both write one transfer, in order, so carry
                # on from wherever it has got to (all of it, once the push has finished).
                offset = replicas.begin(job, role, step, nbytes, digest, header, source, kind="pulled", header_digest=held.header_digest)
        return await replicas.finish(job, role, step)
