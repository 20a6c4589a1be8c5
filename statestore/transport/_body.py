"""The body of a single-request push over HTTP (``PUT /v1/replicas/.../whole``): the shard's
metadata as JSON after its little-endian u32 length, then the shard's bytes."""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator
from typing import Any

_META_LEN = struct.Struct("<I")


def meta_prefix(meta: dict[str, Any]) -> bytes:
    """The start of a single-request push's body: the shard's metadata (as ``begin`` takes it),
    JSON after its little-endian u32 length; the shard's bytes follow."""
    raw = json.dumps(meta, separators=(",", ":")).encode()
    return _META_LEN.pack(len(raw)) + raw


async def read_meta_prefix(body: AsyncIterator[bytes], limit: int = 64 << 20) -> tuple[dict[str, Any], AsyncIterator[bytes]]:
    """Split a single-request push's body into its metadata and the rest of the stream."""
    head = bytearray()
    it = body.__aiter__()

    async def fill(n: int) -> None:
        while len(head) < n:
            try:
                head.extend(await it.__anext__())
            except StopAsyncIteration:
                raise ValueError(f"the body ended after {len(head)} bytes, inside its metadata") from None

    await fill(_META_LEN.size)
    (n,) = _META_LEN.unpack_from(head)
    if n > limit:
        raise ValueError(f"metadata of {n} bytes announced; at most {limit}")
    end = _META_LEN.size + n
    await fill(end)
    meta = json.loads(bytes(head[_META_LEN.size : end]))
    if not isinstance(meta, dict):
        raise ValueError("the metadata is not a JSON object")
    left = bytes(head[end:])

    async def rest() -> AsyncIterator[bytes]:
        if left:
            yield left
        async for piece in it:
            yield piece

    return meta, rest()
