"""The frames of the bulk channel between daemons (``statestore.transport.bulk``): what a push
sends before its bytes, and what the receiver answers after them.

A connection's first request is ``HELLO``: a fixed head whose ``meta_len`` bytes (at most
``HELLO_LIMIT``) are the job's token. Until it is answered 200 the receiver reads nothing larger
than that and allocates nothing more: an unauthenticated peer costs it a fixed few hundred bytes.
Every later request is a fixed little-endian head (``BulkHead``), then ``meta_len`` bytes of JSON
(``BulkMeta``: the shard's metadata, as the HTTP ``begin`` takes it), then ``length`` bytes of the
shard from ``offset``. A reply is a fixed head (status, JSON length) and JSON (``BulkReply``).
Many requests follow one another on one connection.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from ffplane_contract.limits import MAX_BYTES, MAX_STEP, check_name, check_step
from ffplane_contract.shard import META_LIMIT, check_header

MAGIC = b"FFPB"
# 2: headers carry the tree as text (tree_json), which a version-1 daemon would drop;
# 3: a connection authenticates once (HELLO) before any metadata is read
VERSION = 3
HELLO_LIMIT = 1024  # the most a peer may send before it is authenticated: a token
_HEAD = struct.Struct("<4sHHIQQ")
_REPLY = struct.Struct("<HI")
HEAD_SIZE = _HEAD.size
REPLY_HEAD_SIZE = _REPLY.size


class Op(IntEnum):
    PUSH = 1  # bytes follow; the receiver verifies and commits once the last one is in
    PROBE = 2  # no bytes: where is the receiver with this shard (the offset to resume from)
    HELLO = 3  # the metadata is the job's token; a connection's first request, and no other may be


class BulkFrameError(ValueError):
    """A frame that is not one of ours, or names what cannot be: the connection cannot be read on."""


@dataclass(frozen=True)
class BulkHead:
    op: Op
    meta_len: int
    offset: int  # where the bytes that follow start in the shard
    length: int  # how many follow (0 for a probe)

    def pack(self) -> bytes:
        return _HEAD.pack(MAGIC, VERSION, int(self.op), self.meta_len, self.offset, self.length)

    @classmethod
    def unpack(cls, raw: bytes | bytearray | memoryview) -> BulkHead:
        magic, version, op, meta_len, offset, length = _HEAD.unpack(raw)
        if magic != MAGIC:
            raise BulkFrameError(f"not a bulk frame (starts {bytes(magic)!r}); this port takes only daemon pushes")
        if version != VERSION:
            raise BulkFrameError(f"bulk frame version {version}; this daemon speaks {VERSION}: run one ffplane version per ring")
        try:
            kind = Op(op)
        except ValueError:
            raise BulkFrameError(f"unknown bulk op {op}") from None
        if meta_len > (HELLO_LIMIT if kind == Op.HELLO else META_LIMIT):
            raise BulkFrameError(f"metadata of {meta_len} bytes announced; at most {HELLO_LIMIT if kind == Op.HELLO else META_LIMIT}")
        if offset > MAX_BYTES or length > MAX_BYTES - offset:
            raise BulkFrameError(f"a range of {length} bytes at {offset} is past any shard")
        if kind != Op.PUSH and (length or offset):
            raise BulkFrameError(f"a {kind.name.lower()} carries no bytes")
        return cls(kind, meta_len, offset, length)

    @classmethod
    def hello(cls, token: str) -> bytes:
        """The frame that opens a connection: this head and the token."""
        raw = token.encode()
        if len(raw) > HELLO_LIMIT:
            raise BulkFrameError(f"a token of {len(raw)} bytes; the bulk port takes at most {HELLO_LIMIT}")
        return cls(Op.HELLO, len(raw), 0, 0).pack() + raw


@dataclass(frozen=True)
class BulkMeta:
    """What is sent: the shard's metadata, as ``ReplicaStore.begin`` takes it."""

    job: str
    role: str
    step: int
    nbytes: int
    checksum: str
    header: dict[str, Any]
    source: str
    newest: int | None = None  # the sender's newest committed step of the role, when it is the primary
    static: str = ""  # digest of the header's static part, which ``header`` then leaves out
    static_header: dict[str, Any] | None = None  # that part, sent when the receiver may not have it
    header_digest: str = ""  # of the whole header, as the primary recorded it; checked with the checksum

    def pack(self) -> bytes:
        # vars, not asdict: asdict deep-copies the header, and cost a sending daemon 7 % of its CPU
        return json.dumps(vars(self), separators=(",", ":")).encode()

    @classmethod
    def unpack(cls, raw: bytes | bytearray | memoryview) -> BulkMeta:
        """Raises ``ValueError`` naming what is wrong (the receiver answers 422)."""
        try:
            d = json.loads(bytes(raw))
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"bulk metadata is not JSON: {exc}") from None
        if not isinstance(d, dict):
            raise ValueError("bulk metadata is not a JSON object")
        want = {"job": str, "role": str, "step": int, "nbytes": int, "checksum": str, "header": dict, "source": str}
        for key, typ in want.items():
            if type(d.get(key)) is not typ:  # strict: a bool is not a size
                raise ValueError(f"bulk metadata needs {key} as {typ.__name__}, got {type(d.get(key)).__name__}")
        newest = d.get("newest")
        if newest is not None and (type(newest) is not int or not 0 <= newest <= MAX_STEP):
            raise ValueError(f"bulk metadata 'newest' must be a step or null, got {newest!r}")
        if not 0 <= d["nbytes"] <= MAX_BYTES or not 0 < len(d["checksum"]) <= 128 or len(d["source"]) > 256:
            raise ValueError("bulk metadata has an impossible size, checksum or source")
        static, static_header = d.get("static", ""), d.get("static_header")
        if type(static) is not str or len(static) > 128 or not (static_header is None or type(static_header) is dict):
            raise ValueError("bulk metadata 'static' must be a digest, 'static_header' an object or null")
        if static and not static.isalnum():
            raise ValueError(f"bulk metadata 'static' {static!r} is not a digest")
        hdigest = d.get("header_digest", "")
        if type(hdigest) is not str or len(hdigest) > 128 or (hdigest and not hdigest.isalnum()):
            raise ValueError("bulk metadata 'header_digest' must be a digest")
        check_name(d["job"]), check_name(d["role"]), check_step(d["step"])
        check_header(d["header"])
        if static_header is not None:
            check_header(static_header)
        return cls(**{k: d[k] for k in want}, newest=newest, static=static, static_header=static_header, header_digest=hdigest)


@dataclass(frozen=True)
class BulkReply:
    status: int  # as HTTP: 200, 401, 409 (resume from ``received``), 413, 422 (checksum), ...
    received: int = 0  # bytes of the shard the receiver holds
    checksum: str = ""  # of the whole shard, once verified and committed
    detail: str = ""

    def pack(self) -> bytes:
        body = json.dumps({"received": self.received, "checksum": self.checksum, "detail": self.detail}, separators=(",", ":")).encode()
        return _REPLY.pack(self.status, len(body)) + body

    @staticmethod
    def body_len(head: bytes | bytearray | memoryview) -> tuple[int, int]:
        status, n = _REPLY.unpack(head)
        if n > 1 << 20:
            raise BulkFrameError(f"a bulk reply of {n} bytes")
        return status, n

    @classmethod
    def unpack(cls, status: int, body: bytes | bytearray) -> BulkReply:
        d = json.loads(bytes(body))
        return cls(status, int(d.get("received", 0)), str(d.get("checksum", "")), str(d.get("detail", "")))
