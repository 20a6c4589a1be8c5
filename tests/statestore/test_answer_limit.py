"""A daemon reads a data server's JSON answers (job views, ring views, job status) only up to
``ffplane_contract.limits.MAX_ANSWER_BYTES``: declared or streamed past it, the answer is refused
before it is held whole."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from ffplane_contract.errors import InvalidError
from statestore.dataservers import read_answer

LIMIT = 64 << 10


async def _answer(body: bytes, chunked: bool) -> bytes:
    async def handler(request: web.Request) -> web.StreamResponse:
        if not chunked:
            return web.Response(body=body, content_type="application/json")
        resp = web.StreamResponse()  # no Content-Length: the size shows only as it streams
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for i in range(0, len(body), 4096):
            await resp.write(body[i : i + 4096])
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/v1/jobs/j", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/v1/jobs/j") as resp:
            return await read_answer(resp, LIMIT)
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("chunked", [False, True], ids=["declared", "streamed"])
def test_an_answer_within_the_limit_is_read_whole_and_one_past_it_is_refused(chunked: bool) -> None:
    fits = b'{"name": "j", "pad": "' + b"x" * (LIMIT - 30) + b'"}'
    assert asyncio.run(_answer(fits, chunked)) == fits
    with pytest.raises(InvalidError, match=f"at most {LIMIT}"):
        asyncio.run(_answer(fits + b" " * 1024, chunked))
