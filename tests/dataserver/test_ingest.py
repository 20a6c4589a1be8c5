from __future__ import annotations

import base64
import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dataserver.catalog import open_dataset
from dataserver.cli import main as cli_main
from dataserver.ingest import IngestConfig, IngestError, ingest
from tests.conftest import write_image_arrow, write_lmdb, write_token_parquet


def _jsonl(path: Path, rows: list[dict[str, object]] | list[str], gz: bool = False) -> Path:
    lines = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    if gz:
        path.write_bytes(gzip.compress(lines.encode()))
    else:
        path.write_text(lines)
    return path


@pytest.mark.parametrize("gz", [False, True])
def test_jsonl_tokens_become_fixed_width_int32(tmp_path: Path, gz: bool) -> None:
    rows = [{"tokens": [i, i + 1, i + 2, i + 3], "source": f"doc{i}"} for i in range(10_000)]
    src = _jsonl(tmp_path / ("a.jsonl.gz" if gz else "a.jsonl"), rows, gz)
    ingest(IngestConfig([src], tmp_path / "ds", shard_bytes=50_000, progress=False))
    ds = open_dataset(tmp_path / "ds")
    assert ds.num_samples == 10_000
    assert ds.schema.field("tokens").type == pa.list_(pa.int32(), 4)
    got = ds.take(np.array([9_999, 0, 5_000]))
    assert got.column("tokens").to_pylist() == [rows[i]["tokens"] for i in (9_999, 0, 5_000)]
    assert got.column("source").to_pylist() == ["doc9999", "doc0", "doc5000"]
    assert len(json.loads((tmp_path / "ds" / "manifest.json").read_text())["shards"]) > 1


def test_parquet_and_arrow_sources_round_trip(tmp_path: Path) -> None:
    tokens = write_token_parquet(tmp_path / "t.parquet", 500)
    blobs = write_image_arrow(tmp_path / "i.arrow", 200)
    ingest(IngestConfig([tmp_path / "t.parquet"], tmp_path / "t", shard_bytes=10_000, progress=False))
    ingest(IngestConfig([tmp_path / "i.arrow"], tmp_path / "i", shard_bytes=3_000, progress=False))
    t, i = open_dataset(tmp_path / "t"), open_dataset(tmp_path / "i")
    idx = np.array([499, 3, 250, 3, 0])
    assert np.array_equal(np.stack(t.take(idx).column("tokens").to_numpy(zero_copy_only=False)), tokens[idx])
    assert i.take(idx[:4] % 200).column("image").to_pylist() == [blobs[k] for k in idx[:4] % 200]
    assert i.take(np.array([7])).column("label").to_pylist() == [7]


def test_binary_field_from_jsonl(tmp_path: Path) -> None:
    rows = [{"image": base64.b64encode(bytes([i]) * (i + 1)).decode(), "label": i} for i in range(20)]
    src = _jsonl(tmp_path / "img.jsonl", rows)
    ingest(IngestConfig([src], tmp_path / "ds", binary_fields=["image"], progress=False))
    assert open_dataset(tmp_path / "ds").take(np.array([3])).column("image").to_pylist() == [b"\x03" * 4]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"tokens": [1, 2]}', '{"tokens": [3, 4]', '{"tokens": [5, 6]}'], r"bad\.jsonl:2: malformed JSON"),
        (['{"tokens": [1, 2]}', "[1, 2]"], r"bad\.jsonl:2: expected a JSON object"),
        (['{"tokens": [1, 2]}', '{"tokens": [1, 2], "x": 1}'], r"bad\.jsonl:2: fields"),
        (['{"tokens": [1, 2]}'] * 5000 + ['{"tokens": [1, 2, 3]}'], r"bad\.jsonl: row 5000: column 'tokens' has 3 values, expected 2"),
        (['{"tokens": [1, 2]}', '{"tokens": "abc"}'], r"bad\.jsonl:2: cannot mix list and non-list"),
        (['{"a": 1, "t": [1]}'] * 5001 + ['{"a": "x", "t": [1]}'], r"bad\.jsonl:5002: Could not convert 'x'"),
    ],
)
def test_malformed_records_name_file_and_line_and_write_nothing(tmp_path: Path, lines: list[str], message: str) -> None:
    src = _jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(IngestError, match=message):
        ingest(IngestConfig([src], tmp_path / "out", progress=False))
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad.jsonl"]


def test_cli_reports_errors_and_refuses_to_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _jsonl(tmp_path / "bad.jsonl", ['{"tokens": [1]}', "{oops"])
    assert cli_main(["ingest", str(src), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert "bad.jsonl:2: malformed JSON" in capsys.readouterr().err
    good = _jsonl(tmp_path / "good.jsonl", [{"tokens": [1]}])
    assert cli_main(["ingest", str(good), "--out", str(tmp_path / "o"), "--no-progress"]) == 0
    assert cli_main(["ingest", str(good), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    (tmp_path / "x.csv").write_text("a\n1\n")
    with pytest.raises(IngestError, match=r"x\.csv: unknown source type"):
        ingest(IngestConfig([tmp_path / "x.csv"], tmp_path / "o2", progress=False))


def test_corrupt_parquet_is_named(tmp_path: Path) -> None:
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(IngestError, match=r"broken\.parquet: not a readable parquet file"):
        ingest(IngestConfig([tmp_path / "broken.parquet"], tmp_path / "o", progress=False))


def test_lmdb_binary_and_fixed_width(tmp_path: Path) -> None:
    write_lmdb(tmp_path / "bin", [bytes([i]) * i for i in range(1, 30)], None)
    ds = open_dataset(tmp_path / "bin")
    assert ds.num_samples == 29 and ds.schema.field("data").type == pa.binary()
    assert ds.take(np.array([4, 0])).column("data").to_pylist() == [b"\x05" * 5, b"\x01"]

    rows = np.arange(40 * 8, dtype=np.int32).reshape(40, 8)
    write_lmdb(tmp_path / "tok", [r.tobytes() for r in rows], {"num_samples": 40, "column": "tokens", "dtype": "int32", "shape": [8]})
    ds = open_dataset(tmp_path / "tok")
    assert ds.schema.field("tokens").type == pa.list_(pa.int32(), 8)
    got = ds.take(np.array([39, 2])).column("tokens")
    assert np.array_equal(got.values.to_numpy().reshape(2, 8), rows[[39, 2]])


def _ingest_cli(tmp_path: Path, *sources: Path) -> subprocess.CompletedProcess[str]:
    """The real ``dataserver ingest`` command, in its own process."""
    out = tmp_path / "new" / "ds"
    cmd = [sys.executable, "-m", "dataserver", "ingest", *map(str, sources), "--out", str(out), "--no-progress"]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path)


def _gz_lines(n: int) -> bytes:
    return gzip.compress("".join(json.dumps({"tokens": [i, i + 1], "id": i}) + "\n" for i in range(n)).encode())


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        # cut short after about half its compressed bytes: the records before the cut are valid
        ("cut.jsonl.gz", _gz_lines(2000)[:3000], r"cut\.jsonl\.gz:\d+: the gzip data is truncated or corrupt"),
        ("plain.jsonl.gz", b'{"a": 1}\n{"a": 2}\n', r"plain\.jsonl\.gz:1: the file is not gzip data.*drop the \.gz suffix"),
        (
            "big.jsonl",
            b'{"a": 1, "b": [2]}\n{"a": 1180591620717411303424, "b": [3]}\n',
            r"big\.jsonl:2: field 'a' holds the integer 1180591620717411303424, outside the 64-bit range.*string",
        ),
        (
            "bigtok.jsonl",
            b'{"t": [1, 2]}\n' * 4100 + b'{"t": [3, -1180591620717411303424]}\n',
            r"bigtok\.jsonl:4101: field 't\[1\]' holds the integer -1180591620717411303424",
        ),
        ("empty.jsonl", b"{}\n{}\n{}\n", r"empty\.jsonl:1: the record has no fields.*at least one column"),
        ("blank.jsonl", b"\n\n", r"blank\.jsonl: no records \(0 samples\)"),
        ("dup.jsonl", b'{"_sample_index": 7, "a": 1}\n', r"dup\.jsonl:1: field '_sample_index' is reserved.*rename"),
        # issue 39: text rows ingested, and the DataLoader then handed out strings, no tokens
        (
            "text.jsonl",
            b'{"text": "the quick brown fox"}\n',
            r"text\.jsonl:1: no token ids: expected a field of token ids, a list of ints, e\.g\. \{\"tokens\": \[.*'text' \(str\).*Tokenize",
        ),
        ("str.jsonl", b'{"tokens": "464 2068 318", "id": 1}\n', r"str\.jsonl:1: no token ids.*'id' \(int\), 'tokens' \(str\)"),
        ("nested.jsonl", b'{"tokens": [[464], [2068]]}\n', r"nested\.jsonl:1: no token ids.*'tokens' \(list\)"),
    ],
)
def test_cli_refuses_bad_sources_naming_file_and_line(tmp_path: Path, name: str, content: bytes, message: str) -> None:
    src = tmp_path / name
    src.write_bytes(content)
    run = _ingest_cli(tmp_path, src)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dataserver ingest: error: "), run.stderr
    assert re.search(message, lines[0]), lines[0]
    assert [p.name for p in tmp_path.iterdir()] == [name]  # neither --out nor its parent nor a partial


def test_cli_refuses_columnar_sources_with_no_rows_or_a_reserved_column(tmp_path: Path) -> None:
    pq.write_table(pa.table({"_sample_index": [1, 2], "a": [1, 2]}), tmp_path / "dup.parquet")
    empty = pa.record_batch([pa.array([], pa.int64())], names=["a"])
    with pa.ipc.new_file(str(tmp_path / "empty.arrow"), empty.schema) as w:
        w.write_batch(empty)
    for src, message in [
        ("dup.parquet", r"dup\.parquet: row 0: field '_sample_index' is reserved"),
        ("empty.arrow", r"empty\.arrow: no records \(0 samples\)"),
    ]:
        run = _ingest_cli(tmp_path, tmp_path / src)
        assert run.returncode == 2 and re.search(message, run.stderr), run.stderr
        assert not (tmp_path / "new").exists()
