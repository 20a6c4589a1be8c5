"""The bulk channel's frames (``statestore.transport.bulk_wire``): each one round-trips, and what is
not a frame of ours, or names the impossible, is refused with a reason."""

from __future__ import annotations

import pytest

from statestore.transport.bulk_wire import (
    HEAD_SIZE,
    HELLO_LIMIT,
    META_LIMIT,
    REPLY_HEAD_SIZE,
    BulkFrameError,
    BulkHead,
    BulkMeta,
    BulkReply,
    Op,
)

META = BulkMeta("job", "dp0-pp0-tp0", 7, 4096, "0123abcd", {"tree": {"w": 1}, "layout_roles": ["dp0-pp0-tp0"]}, "n0", newest=7)


def test_every_frame_round_trips() -> None:
    for head in (
        BulkHead(Op.PUSH, 120, 0, 4096),
        BulkHead(Op.PUSH, 1, 4000, 96),
        BulkHead(Op.PROBE, 99, 0, 0),
        BulkHead(Op.HELLO, 32, 0, 0),
    ):
        raw = head.pack()
        assert len(raw) == HEAD_SIZE and BulkHead.unpack(raw) == head
    with_static = BulkMeta("j", "r", 3, 9, "c", {"tree": [1]}, "s", 2, static="9f86d081", static_header={"tensors": []})
    for meta in (META, BulkMeta("j", "r", 0, 0, "c", {}, "s", None), with_static):
        assert BulkMeta.unpack(meta.pack()) == meta
    hello = BulkHead.hello("t" * 32)
    assert BulkHead.unpack(hello[:HEAD_SIZE]) == BulkHead(Op.HELLO, 32, 0, 0) and hello[HEAD_SIZE:] == b"t" * 32
    with pytest.raises(BulkFrameError, match="at most"):
        BulkHead.hello("t" * (HELLO_LIMIT + 1))
    for reply in (BulkReply(200, 4096, "0123abcd"), BulkReply(409, 17, detail="resume from 17"), BulkReply(422, detail="checksum")):
        raw = reply.pack()
        status, n = BulkReply.body_len(raw[:REPLY_HEAD_SIZE])
        assert n == len(raw) - REPLY_HEAD_SIZE and BulkReply.unpack(status, raw[REPLY_HEAD_SIZE:]) == reply


@pytest.mark.parametrize(
    "raw, why",
    [
        (b"GET / HTTP/1.1\r\nHost: example.org\r\n\r\n"[:HEAD_SIZE], "not a bulk frame"),
        (BulkHead(Op.PUSH, 1, 0, 1).pack()[:4] + (9).to_bytes(2, "little") + BulkHead(Op.PUSH, 1, 0, 1).pack()[6:], "version 9"),
        (BulkHead(Op.PUSH, 1, 0, 1).pack()[:6] + (7).to_bytes(2, "little") + BulkHead(Op.PUSH, 1, 0, 1).pack()[8:], "unknown bulk op 7"),
        (BulkHead(Op.PUSH, META_LIMIT + 1, 0, 1).pack(), "at most"),
        (BulkHead(Op.PUSH, 1, (1 << 63) - 1, 2).pack(), "past any shard"),
        (BulkHead(Op.PROBE, 1, 0, 5).pack(), "a probe carries no bytes"),
        (BulkHead(Op.HELLO, 1, 0, 5).pack(), "a hello carries no bytes"),
        (BulkHead(Op.HELLO, HELLO_LIMIT + 1, 0, 0).pack(), "at most 1024"),  # before the token: a token's size
    ],
)
def test_a_head_that_is_not_ours_is_refused(raw: bytes, why: str) -> None:
    with pytest.raises(BulkFrameError, match=why):
        BulkHead.unpack(raw)


@pytest.mark.parametrize(
    "raw, why",
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (META.pack().replace(b'"nbytes":4096', b'"nbytes":true'), "nbytes as int, got bool"),
        (META.pack().replace(b'"job":"job"', b'"job":"../etc"'), "invalid name"),
        (META.pack().replace(b'"step":7', b'"step":-1'), "step must be"),
        (META.pack().replace(b'"newest":7', b'"newest":"7"'), "'newest' must be a step"),
        (META.pack().replace(b'"checksum":"0123abcd"', b'"checksum":""'), "impossible size, checksum"),
        (META.pack().replace(b'"static":""', b'"static":"../x"'), "is not a digest"),
        (META.pack().replace(b'"static_header":null', b'"static_header":[1]'), "'static_header' an object"),
        (META.pack().replace(b'"layout_roles":["dp0-pp0-tp0"]', b'"layout_roles":"dp0"'), "layout_roles"),
        (META.pack().replace(b'"static_header":null', b'"static_header":{"tensors":{}}'), "tensors"),
    ],
)
def test_metadata_that_names_the_impossible_is_refused(raw: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        BulkMeta.unpack(raw)
