"""The data servers a daemon talks to (``--dataserver U1,U2,...``): every one serves batches; one at
a time coordinates (heartbeats, ring views, restore status).

Batch fetches are spread over the servers step by step from an offset per stream, so N servers
share a node's streams evenly; a server that refuses a connection, resets one or answers 5xx is
passed over for a few seconds and the fetch goes to the next at once (a batch is a pure function
of its TID, so any server's copy is the same bytes). Coordinator requests go to the server
believed to coordinate; one that does not answers 421 naming the one that does
(``X-FFplane-Leader``), and a server that does not answer is replaced by the next in the list.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from typing import Any

import aiohttp

from ffplane_contract.errors import InvalidError
from ffplane_contract.limits import MAX_ANSWER_BYTES
from ffplane_contract.servers import LEADER_HEADER, parse_urls

log = logging.getLogger(__name__)

_DOWN_S = 5.0  # a server that failed is tried last for this long


class DataServers:
    def __init__(self, spec: str) -> None:
        self.urls = parse_urls(spec)
        self.leader = self.urls[0]  # the server believed to coordinate
        self._down: dict[str, float] = {}  # url → monotonic time until which it is tried last

    def __str__(self) -> str:
        return ",".join(self.urls)

    def for_step(self, key: str, step: int) -> list[str]:
        """Every server, in the order a fetch of ``step`` of stream ``key`` tries them."""
        n = len(self.urls)
        at = (zlib.crc32(key.encode()) + step) % n
        order = self.urls[at:] + self.urls[:at]
        now = time.monotonic()
        return sorted(order, key=lambda url: self._down.get(url, 0.0) > now)  # stable: failed ones last

    def for_run(self, key: str, first: int, fetch_steps: int) -> list[str]:
        """``for_step`` for a run of steps from ``first``: servers take turns by run, since in a
        steady stream runs start ``fetch_steps`` apart and the first step's turn would send every
        run of a stream to the same server."""
        return self.for_step(key, first // fetch_steps)

    def failed(self, url: str) -> None:
        """``url`` did not answer (or answered 5xx): passed over for a while; if it was believed
        to coordinate, the next server is asked instead."""
        if self._down.get(url, 0.0) <= time.monotonic():
            log.warning("data server failing; using the others", extra={"dataserver": url, "for_s": _DOWN_S})
        self._down[url] = time.monotonic() + _DOWN_S
        if url == self.leader and len(self.urls) > 1:
            self._next_leader()

    def answered(self, url: str) -> None:
        self._down.pop(url, None)

    def redirected(self, url: str, hint: str | None) -> None:
        """``url`` does not coordinate; ``hint`` is the server it says does. It is followed even
        when it failed lately (a busy leader may miss one timeout); while none is named, or the
        named one just died and etcd has not expired its lease yet, the servers are asked in turn."""
        hint = (hint or "").rstrip("/")
        if hint and hint != url:
            if hint != self.leader:
                log.info("coordinating data server found", extra={"dataserver": hint, "told_by": url})
            self.leader = hint
        elif url == self.leader and len(self.urls) > 1:
            self._next_leader()

    def _next_leader(self) -> None:
        at = self.urls.index(self.leader) if self.leader in self.urls else -1
        now = time.monotonic()
        for i in range(1, len(self.urls) + 1):
            url = self.urls[(at + i) % len(self.urls)]
            if self._down.get(url, 0.0) <= now:
                self.leader = url
                return
        self.leader = self.urls[(at + 1) % len(self.urls)]

    async def coordinator(
        self,
        session: aiohttp.ClientSession,
        method: str,
        path: str,
        *,
        attempts: int | None = None,
        patience_s: float = 0.0,
        **kwargs: Any,
    ) -> tuple[int, bytes]:
        """``method path`` to the coordinating server: (status, body). Follows 421 redirects and
        moves past servers that do not answer (``attempts`` requests at most, default one per
        server and one more); a 503 of a server that just took over is asked again for up to
        ``patience_s``. Raises the last connection error when no server answered."""
        deadline = time.monotonic() + patience_s
        tries = attempts if attempts is not None else len(self.urls) + 1
        last_exc: BaseException | None = None
        status, body = 0, b""
        while tries > 0:
            url = self.leader
            try:
                async with session.request(method, f"{url}{path}", **kwargs) as resp:
                    status, body = resp.status, await read_answer(resp)
                    hint = resp.headers.get(LEADER_HEADER)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                last_exc, tries = exc, tries - 1
                self.failed(url)
                continue
            self.answered(url)
            if status == 421:
                self.redirected(url, hint)
                tries -= 1
                continue
            if status == 503 and time.monotonic() < deadline:  # taking over: ask the same one again
                await asyncio.sleep(min(0.3, max(0.0, deadline - time.monotonic())))
                continue
            return status, body
        if status == 0 and last_exc is not None:
            raise last_exc
        return status, body


async def read_answer(resp: aiohttp.ClientResponse, limit: int = MAX_ANSWER_BYTES) -> bytes:
    """A data server's JSON answer, read only while within ``limit``: a server that is wrong (or
    not ours) cannot make this daemon hold an unbounded body. ``InvalidError`` past it."""
    if resp.content_length is not None and resp.content_length > limit:
        raise InvalidError(f"{resp.url} answered {resp.content_length} bytes; at most {limit} are read")
    body = bytearray()
    async for chunk in resp.content.iter_any():
        body += chunk
        if len(body) > limit:
            raise InvalidError(f"{resp.url} answered over {limit} bytes; at most {limit} are read")
    return bytes(body)
