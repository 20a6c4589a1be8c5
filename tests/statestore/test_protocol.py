"""Round trips of the wire formats ``ffplane_contract`` defines: control-socket messages, the
shard header, shared file names, the durable tier's files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ffplane_contract import control as proto
from ffplane_contract import durable, files
from ffplane_contract.errors import SlotBusyError
from ffplane_contract.shard import check_header, layout_roles, lineage

REQUESTS: list[proto.Request] = [
    proto.Open("job", 3, "tok"),
    proto.Open("job", 0),
    proto.Get(12),
    proto.Alloc("job", "dp0-pp0-tp0", 1 << 20),
    proto.Begin("job", "dp0-pp0-tp0", 7),
    proto.Abort("job", "dp0-pp0-tp0", "state/job/dp0-pp0-tp0/s1"),
    proto.Commit("job", "dp1-pp0-tp0", 7, "slot", 100, {"tree": {"w": ["T", 0]}}, 0.01, True, "abc123", {"tensors": []}),
    proto.Commit("job", "dp1-pp0-tp0", 8, "slot", 100, {"tree": {}}),
    proto.Commit("job", "dp1-pp0-tp0", 9, "slot", 100, {"tree": {}}, settled=True),
    proto.Begin("job", "dp1-pp0-tp0", 9, settled=True),
    proto.Restorable("job", False, 9, ["dp0-pp0-tp0", "dp1-pp0-tp0"], 8),
    proto.Restorable("job"),
    proto.Verify("job", 8, ["dp0-pp0-tp0"]),
    proto.Ping(),
]


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: r.op)
def test_every_request_round_trips(request_: proto.Request) -> None:
    line = proto.encode(request_)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert proto.decode_request(line) == request_


REPLIES: list[tuple[proto.Request, Any]] = [
    (proto.Open("j", 0), proto.OpenReply("/dev/shm/ffplane", "data/j/0")),
    (proto.Get(1), proto.GetReply("data/j/0/000000000001.arrow", 4096, True)),
    (proto.Alloc("j", "r", 1), proto.AllocReply(["/a", "/b", "/c"], 30.0)),
    (proto.Begin("j", "r", 1), proto.Grant("state/j/r/s0", "/dev/shm/ffplane/state/j/r/s0")),
    (proto.Commit("j", "r", 1, "s", 1, {"tree_json": "{}"}), proto.CommitReply("0123abcd", proto.Grant("s1", "/x/s1"))),
    (proto.Commit("j", "r", 1, "s", 1, {"tree_json": "{}"}), proto.CommitReply("0123abcd", None)),
    (proto.Commit("j", "r", 2, "s", 1, {"tree_json": "{}"}, settled=True), proto.CommitReply("0123abcd", proto.Grant("s0", "/x/s0", True))),
    (proto.Begin("j", "r", 2, settled=True), proto.Grant("s0", "/x/s0", True)),
    (proto.Restorable("j"), proto.RestorableReply(5, "memory", {"r": {"path": "/x", "offset": 0}}, None, False)),
    (proto.Restorable("j"), proto.RestorableReply(None, None, {}, "every copy failed its checksum", True)),
    (proto.Verify("j", 1), proto.VerifyReply(False, ["r"])),
    (proto.Ping(), proto.Done()),
]


@pytest.mark.parametrize("pair", REPLIES, ids=lambda p: type(p[1]).__name__)
def test_every_reply_round_trips(pair: tuple[proto.Request, Any]) -> None:
    request_, reply = pair
    assert proto.decode_reply(request_, json.loads(proto.encode(reply))) == reply


def test_an_error_reply_comes_back_as_the_type_the_daemon_raised() -> None:
    line = proto.encode_error(SlotBusyError("no free slot for r step 3"))
    with pytest.raises(SlotBusyError, match="no free slot"):
        proto.decode_reply(proto.Begin("j", "r", 3), json.loads(line))


@pytest.mark.parametrize(
    "line, says",
    [
        (b"[1, 2]", "JSON object"),
        (b'{"op": "fly"}', "unknown op"),
        (b'{"op": "open", "job": "../etc", "dp_rank": 0}', "invalid name"),
        (b'{"op": "open", "job": "j", "dp_rank": -1}', "dp_rank"),
        (b'{"op": "open", "job": "j"}', "dp_rank"),
        (b'{"op": "begin", "job": "j", "role": "r", "step": -4}', "step"),
        (b'{"op": "get", "step": -1}', "step"),
        (b'{"op": "begin", "job": "j", "role": "r", "step": null}', "'step'"),  # only optional fields take null
        (b'{"op": "commit", "job": "j", "role": "r", "step": 1, "slot": "s", "nbytes": 1, "header": []}', "header"),
        (b'{"op": "commit", "job": "j", "role": "r", "step": 1, "slot": "s", "nbytes": 1, "header": {}, "static_header": {}}', "static"),
        (b'{"op": "commit", "job": "j", "role": "r", "step": 1, "slot": "s", "nbytes": 1, "header": {}}', "tree"),
        (b'{"op": "commit", "job": "j", "role": "r", "step": 1, "slot": "s", "nbytes": 1, "header": {"tree_json": 5}}', "tree_json"),
        (
            b'{"op": "commit", "job": "j", "role": "r", "step": 1, "slot": "s", "nbytes": 1, "header": {"tree_json": "{}"},'
            b' "static": "ab12", "static_header": {"tensors": {}}}',
            "tensors",
        ),
        (b'{"op": "restorable", "job": "j", "roles": "r"}', "roles"),
    ],
)
def test_a_malformed_request_is_refused_naming_the_problem(line: bytes, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        proto.decode_request(line)


def test_the_shard_header_type_and_its_fields_the_daemon_reads() -> None:
    header = {"role": "dp0-pp0-tp0", "layout_roles": ["dp0-pp0-tp0", "dp1-pp0-tp0"], "lineage": 5, "piece": [0, 8], "private_nbytes": 0}
    assert check_header(json.loads(json.dumps(header))) == header
    assert layout_roles(header, "x") == ["dp0-pp0-tp0", "dp1-pp0-tp0"] and layout_roles({}, "x") == ["x"]
    assert lineage(header) == 5 and lineage({}) == 0
    with pytest.raises(ValueError, match="layout_roles"):
        check_header({"layout_roles": "dp0"})


def test_shared_file_names(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert files.step_file(42) == "000000000042.arrow"
    monkeypatch.delenv(files.SOCKET_ENV, raising=False)
    assert files.socket_path() == files.DEFAULT_SOCKET
    monkeypatch.setenv(files.SOCKET_ENV, str(tmp_path / "d.sock"))
    assert files.socket_path() == tmp_path / "d.sock" and files.socket_path("/x.sock") == Path("/x.sock")
    assert files.hint_path(tmp_path, 77) == tmp_path / "hints" / "77" and files.HINT.size == 8


def test_a_durable_shard_file_reads_back_with_its_header_and_checksum(tmp_path: Path) -> None:
    from ffplane_contract.checksum import checksum
    from statestore.durable import write_shard

    data = memoryview(bytes(range(256)) * 3)
    header = {"layout_roles": ["dp0-pp0-tp0"], "lineage": 1}
    path = write_shard(tmp_path, "job", "dp0-pp0-tp0", 6, data, checksum(data), header)
    assert path == durable.shard_path(tmp_path, "job", "dp0-pp0-tp0", 6)
    meta, offset, length = durable.read_meta(path)
    assert path.read_bytes()[offset : offset + length] == bytes(data) and json.loads(meta["ffplane_header"]) == header
    step, shards = durable.restorable(tmp_path, "job")
    assert step == 6 and shards["dp0-pp0-tp0"]["checksum"] == checksum(data)
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert durable.restorable(tmp_path, "job") == (None, {})
