"""Round trips of the wire formats ``ffplane_contract`` defines: heartbeat datagrams, errors, auth."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ffplane_contract import auth, errors
from ffplane_contract import heartbeat as hb

KEY = b"job-token"


def test_a_beat_and_an_answer_round_trip_and_a_tampered_or_foreign_one_is_dropped() -> None:
    inventory = {"job": {"dp0-pp0-tp0": [{"step": 3, "checksum": "ab", "nbytes": 9, "layout_roles": ["dp0-pp0-tp0"]}]}}
    beat = hb.Beat(hb.KIND_INV, "node-é", b"12345678", 7, 7, 2, 5, hb.encode_inventory(inventory, [{"pid": 4}]))
    data = beat.encode(KEY)
    assert hb.Beat.decode(KEY, data) == beat
    assert hb.decode_inventory(beat.payload) == (inventory, [{"pid": 4}])
    assert hb.Beat.decode(b"another-token", data) is None
    assert hb.Beat.decode(KEY, data[:-1] + bytes([data[-1] ^ 1])) is None
    assert hb.Beat.decode(KEY, data[:10]) is None
    answer = hb.Answer(hb.STATUS_STALE, hb.VIEW_EVENTS, 7, 2, 6, hb.encode_events([["+", "b", "http://10.0.0.2:1"], ["-", "c"]]))
    assert hb.Answer.decode(KEY, answer.encode(KEY)) == answer
    assert hb.decode_events(answer.events) == [["+", "b", "http://10.0.0.2:1"], ["-", "c"]]
    assert hb.Answer.decode(KEY, data) is None  # a beat is not an answer
    with pytest.raises(ValueError):
        hb.decode_events(b'[["?", "x"]]')


def test_an_inventory_too_large_once_inflated_is_refused() -> None:
    import zlib

    with pytest.raises(ValueError, match="too large"):
        hb.decode_inventory(zlib.compress(b"[" + b" " * (hb.MAX_INVENTORY_BYTES + 10) + b"{}, []]"))


def test_a_beat_too_big_for_a_datagram_says_so() -> None:
    assert hb.Beat.room("n", b"x" * 100)
    assert not hb.Beat.room("n", b"x" * hb.MAX_DATAGRAM)


@pytest.mark.parametrize("cls", sorted(errors._KINDS.values(), key=lambda c: c.__name__))
def test_every_error_travels_as_its_kind_and_comes_back_the_same_type(cls: type[errors.FFPlaneError]) -> None:
    sent = cls("what went wrong")
    back = errors.error_from(sent.status, str(sent), errors.kind_of(sent))
    assert type(back) is cls and back.status == sent.status and "what went wrong" in str(back)


def test_a_subclass_travels_as_its_nearest_shared_kind_and_a_kindless_answer_by_its_status() -> None:
    class _Local(errors.UnavailableError):
        pass

    assert errors.kind_of(_Local("x")) == "UnavailableError"
    assert type(errors.error_from(416, "past the end")) is errors.NotFoundError
    assert type(errors.error_from(409, "busy")) is errors.FFPlaneError  # no kind: the base, never a guess
    assert type(errors.error_from(502, "gone")) is errors.TransportError
    assert type(errors.error_from(400, "bad", "NoSuchKind")) is errors.FFPlaneError
    assert "FFPLANE_TOKEN" in str(errors.error_from(401, "refused"))


def test_the_bearer_header_and_the_token_sources(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert auth.bearer("t0k") == {"Authorization": "Bearer t0k"} and auth.bearer(None) == {}
    monkeypatch.setenv(auth.TOKEN_ENV, "from-env")
    monkeypatch.delenv(auth.TOKEN_FILE_ENV, raising=False)
    assert auth.load_token() == "from-env"
    (tmp_path / "tok").write_text("from-file\n")
    assert auth.load_token(str(tmp_path / "tok")) == "from-file"
    (tmp_path / "empty").write_text("")
    with pytest.raises(errors.UnauthorisedError, match="the token file .*empty is empty"):
        auth.load_token(str(tmp_path / "empty"))
    monkeypatch.setenv(auth.TOKEN_FILE_ENV, str(tmp_path / "absent"))  # the file wins over the variable
    with pytest.raises(errors.UnauthorisedError, match="cannot read the token file .*absent"):
        auth.load_token()


def test_an_unreadable_token_file_is_an_error_library_code_raises_and_commands_refuse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer_client.jobs import Jobs

    monkeypatch.setenv(auth.TOKEN_FILE_ENV, str(tmp_path / "absent"))
    with pytest.raises(errors.UnauthorisedError, match="cannot read the token file"):  # not SystemExit: a library raises
        Jobs("http://127.0.0.1:9")
    argv = ["serve", "--dataserver", "http://127.0.0.1:9", "--root", str(tmp_path), "--allow-non-tmpfs"]
    r = subprocess.run(
        [sys.executable, "-m", "statestore", *argv, "--token-file", str(tmp_path / "absent")], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("statestore serve: error: cannot read the token file")
