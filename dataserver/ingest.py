"""``dataserver ingest``: JSONL, JSONL.GZ, Parquet and Arrow sources → an ffplane Arrow dataset.

The served form is a directory with Arrow IPC *file* shards (memory-mappable, random access) and
``manifest.json`` (format, row count, each shard's rows, bytes and CRC-32). Lists of integers
whose length is the same in every row (token ids) become ``fixed_size_list`` columns so that
readers get them zero-copy as a 2-D tensor. Nothing is written to ``--out`` unless every record
of every source is valid and there is at least one sample: the dataset is built in a sibling
folder and renamed into place. A JSONL record must hold token ids (a field that is a list of ints,
``{"tokens": [464, 2068, ...]}``) unless ``--binary-field`` names its payload: ingest does not
tokenize. Every refusal is an :class:`IngestError` whose one-line message
names the file and the line (JSONL) or row (Parquet/Arrow) and says what to fix.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import shutil
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from dataserver._arrow_dataset import FORMAT, MANIFEST_NAME, file_crc32
from dataserver.catalog import SAMPLE_INDEX_COLUMN

_ROWS_PER_BATCH = 4096
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


class IngestError(Exception):
    """A source record is malformed; the message names the file and the line or row."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.splitlines()))  # one line, whatever Arrow says


@dataclass
class IngestConfig:
    sources: list[Path]
    out: Path
    shard_bytes: int = 256 << 20
    binary_fields: list[str] = field(default_factory=list)  # base64 in JSONL → binary
    list_int_type: str = "int32"  # integer lists from JSONL (token ids)
    progress: bool = True


def _source_kind(path: Path) -> str:
    name = path.name.lower()
    for suffix, kind in (
        (".jsonl.gz", "jsonl"), (".json.gz", "jsonl"), (".jsonl", "jsonl"), (".ndjson", "jsonl"),
        (".parquet", "parquet"), (".arrow", "arrow"), (".feather", "arrow"), (".ipc", "arrow"),
    ):  # fmt: skip
        if name.endswith(suffix):
            return kind
    raise IngestError(f"{path}: unknown source type; expected .jsonl, .jsonl.gz, .parquet or .arrow/.feather")


def _check_columns(names: list[str], where: str) -> None:
    """Refuse a source whose records have no fields, or a field the server adds itself."""
    if not names:
        raise IngestError(f"{where}: the record has no fields; a dataset needs at least one column (fix or drop the empty records)")
    if SAMPLE_INDEX_COLUMN in names:
        raise IngestError(
            f"{where}: field {SAMPLE_INDEX_COLUMN!r} is reserved (the server adds it to every "
            "batch as the sample's dataset row); rename or drop that field in the source"
        )


def _check_token_ids(rec: dict[str, Any], where: str) -> None:
    """Refuse a JSONL record with no field of token ids: text rows ingested fine and the
    DataLoader then handed out strings, no ``tokens`` tensor."""
    if any(isinstance(v, list) and v and all(isinstance(i, int) and not isinstance(i, bool) for i in v) for v in rec.values()):
        return
    got = ", ".join(f"{k!r} ({type(v).__name__})" for k, v in sorted(rec.items()))
    raise IngestError(
        f'{where}: no token ids: expected a field of token ids, a list of ints, e.g. {{"tokens": [464, 2068, 318]}}; '
        f"the record has {got}. Tokenize the text first (a record of bytes: name its base64 field with --binary-field)"
    )


class _Normaliser:
    """Makes every batch match the first one's schema, fixing list widths to fixed-size lists."""

    def __init__(self, cfg: IngestConfig) -> None:
        self.cfg = cfg
        self.schema: pa.Schema | None = None

    def __call__(self, batch: pa.RecordBatch, where: str, first_row: int, from_json: bool) -> pa.RecordBatch:
        if self.schema is None:
            _check_columns(batch.schema.names, f"{where}: row {first_row}")
            self.schema = self._decide_schema(batch, from_json)
        if set(batch.schema.names) != set(self.schema.names):
            raise IngestError(
                f"{where}: rows {first_row}..: columns {sorted(batch.schema.names)} differ from "
                f"the first source's {sorted(self.schema.names)}"
            )
        arrays = []
        for f in self.schema:
            col = batch.column(f.name)
            if pa.types.is_fixed_size_list(f.type) and not pa.types.is_fixed_size_list(col.type):
                col = self._to_fixed(col, f, where, first_row)
            try:
                arrays.append(col.cast(f.type))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise IngestError(
                    f"{where}: rows {first_row}..{first_row + len(batch) - 1}: column {f.name!r} does not convert to {f.type}: {exc}"
                ) from exc
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)

    def _decide_schema(self, batch: pa.RecordBatch, from_json: bool) -> pa.Schema:
        fields = []
        for f in batch.schema:
            t = f.type
            if pa.types.is_list(t) or pa.types.is_large_list(t):
                col = batch.column(f.name)
                lengths = col.value_lengths().unique()
                if len(lengths) == 1 and lengths[0].as_py() and pa.types.is_integer(t.value_type):
                    value_type = t.value_type
                    # JSON has no integer width; token ids fit int32 and halve the bytes moved.
                    if from_json and pa.types.is_int64(value_type) and self.cfg.list_int_type == "int32":
                        value_type = pa.int32()
                    t = pa.list_(value_type, lengths[0].as_py())
            fields.append(pa.field(f.name, t))
        return pa.schema(fields)

    @staticmethod
    def _to_fixed(col: pa.Array, f: pa.Field, where: str, first_row: int) -> pa.Array:
        width = f.type.list_size
        lengths = col.value_lengths().to_numpy(zero_copy_only=False)
        bad = (lengths != width).nonzero()[0]
        if len(bad):
            row = first_row + int(bad[0])
            raise IngestError(
                f"{where}: row {row}: column {f.name!r} has {lengths[bad[0]]} values, expected "
                f"{width} like the first row (token arrays must all have one length)"
            )
        return pa.FixedSizeListArray.from_arrays(col.flatten(), width)


def _read_lines(path: Path, stream: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    """``(line number, line)``; a gzip stream that is not gzip, corrupt or cut short, or a read
    that fails, becomes an IngestError naming the line where reading stopped."""
    lineno = 0
    lines = iter(stream)
    while True:
        try:
            line = next(lines)
        except StopIteration:
            return
        except gzip.BadGzipFile as exc:
            what = "is not gzip data" if lineno == 0 else "is corrupt gzip data"
            raise IngestError(
                f"{path}:{lineno + 1}: the file {what} ({exc}); recompress it, or drop the .gz suffix if it is plain JSONL"
            ) from exc
        except (EOFError, zlib.error) as exc:
            raise IngestError(
                f"{path}:{lineno + 1}: the gzip data is truncated or corrupt ({exc}); re-create or re-download the file"
            ) from exc
        except OSError as exc:
            raise IngestError(f"{path}:{lineno + 1}: read failed: {exc}") from exc
        lineno += 1
        yield lineno, line


def _jsonl_batches(path: Path, cfg: IngestConfig, bar: tqdm) -> Iterator[tuple[pa.RecordBatch, str, int]]:
    try:
        raw = open(path, "rb")  # noqa: SIM115 - closed by the ``with`` below
    except OSError as exc:
        raise IngestError(f"{path}: cannot open: {exc}") from exc
    stream: IO[bytes] = gzip.GzipFile(fileobj=raw) if path.name.lower().endswith(".gz") else raw  # type: ignore[assignment]
    rows: list[dict[str, Any]] = []
    linenos: list[int] = []  # source line of each row in ``rows``
    keys: list[str] | None = None
    first_row = 0  # 0-based record number of the block's first row
    last_pos = 0
    with raw, stream:
        for lineno, line in _read_lines(path, stream):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as exc:
                raise IngestError(f"{path}:{lineno}: malformed JSON: {exc}") from exc
            if not isinstance(rec, dict):
                raise IngestError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            if keys is None:
                keys = sorted(rec)
                _check_columns(keys, f"{path}:{lineno}")
                if not cfg.binary_fields:  # a record of bytes (images...) names them instead
                    _check_token_ids(rec, f"{path}:{lineno}")
            elif sorted(rec) != keys:
                raise IngestError(f"{path}:{lineno}: fields {sorted(rec)} differ from the first record's {keys}")
            for name in cfg.binary_fields:
                try:
                    rec[name] = base64.b64decode(rec[name], validate=True)
                except (KeyError, TypeError, ValueError) as exc:
                    raise IngestError(f"{path}:{lineno}: field {name!r} is not base64: {exc}") from exc
            rows.append(rec)
            linenos.append(lineno)
            if len(rows) == _ROWS_PER_BATCH:
                yield _rows_to_batch(rows, path, linenos), str(path), first_row
                first_row += len(rows)
                rows, linenos = [], []
                pos = raw.tell()
                bar.update(pos - last_pos)
                last_pos = pos
    if rows:
        yield _rows_to_batch(rows, path, linenos), str(path), first_row
    bar.update(path.stat().st_size - last_pos)


def _rows_to_batch(rows: list[dict[str, Any]], path: Path, linenos: list[int]) -> pa.RecordBatch:
    try:
        return pa.RecordBatch.from_pylist(rows)
    except (pa.ArrowException, OverflowError) as exc:
        error: Exception = exc
    # Name the offending line so the user can fix it without bisecting the file: the first
    # prefix of the block that does not convert ends with it (a prefix that fails keeps failing).
    lo, hi = 0, len(rows) - 1  # rows[: hi + 1] fails
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            pa.RecordBatch.from_pylist(rows[: mid + 1])
            lo = mid + 1
        except (pa.ArrowException, OverflowError) as exc:
            hi, error = mid, exc
    where = f"{path}:{linenos[hi]}"
    big = _first_big_int(rows[hi]) if isinstance(error, OverflowError) else None
    if big is not None:
        digits = str(big[1])
        shown = digits if len(digits) <= 40 else f"{digits[:12]}... ({len(digits)} digits)"
        raise IngestError(
            f"{where}: field {big[0]!r} holds the integer {shown}, outside the 64-bit range "
            f"[-2^63, 2^63-1]; store it as a string (or a float) in the source"
        ) from error
    raise IngestError(f"{where}: {error}") from error


def _first_big_int(value: Any, name: str = "") -> tuple[str, int] | None:
    """The first ``(field, integer)`` of a record that does not fit in int64, if any."""
    if isinstance(value, int) and not isinstance(value, bool):
        return None if _INT64_MIN <= value <= _INT64_MAX else (name, value)
    if isinstance(value, dict):
        items: Iterator[tuple[str, Any]] = ((f"{name}.{k}" if name else k, v) for k, v in value.items())
    elif isinstance(value, list):
        items = ((f"{name}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for item_name, item in items:
        if (found := _first_big_int(item, item_name)) is not None:
            return found
    return None


def _columnar_batches(path: Path, kind: str, bar: tqdm) -> Iterator[tuple[pa.RecordBatch, str, int]]:
    try:
        if kind == "parquet":
            pf = pq.ParquetFile(path)
            batches: Iterator[pa.RecordBatch] = pf.iter_batches(batch_size=_ROWS_PER_BATCH)
        else:
            try:
                reader: Any = pa.ipc.open_file(pa.memory_map(str(path)))
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:
                batches = iter(pa.ipc.open_stream(pa.memory_map(str(path))))
    except (OSError, pa.ArrowInvalid) as exc:
        raise IngestError(f"{path}: not a readable {kind} file: {exc}") from exc
    size = path.stat().st_size
    row = 0
    done = 0
    try:
        for batch in batches:
            yield batch, str(path), row
            row += len(batch)
            step = min(size - done, batch.nbytes)
            bar.update(step)
            done += step
    except (OSError, pa.ArrowInvalid) as exc:
        raise IngestError(f"{path}: row {row}..: unreadable {kind} data: {exc}") from exc
    bar.update(size - done)


class _ShardWriter:
    def __init__(self, out: Path, shard_bytes: int) -> None:
        self.out = out
        self.shard_bytes = shard_bytes
        self.shards: list[dict[str, Any]] = []
        self._writer: pa.ipc.RecordBatchFileWriter | None = None
        self._rows = 0
        self._bytes = 0

    def write(self, batch: pa.RecordBatch) -> None:
        if self._writer is None:
            path = self.out / f"shard-{len(self.shards):05d}.arrow"
            self._writer = pa.ipc.new_file(str(path), batch.schema)
            self.shards.append({"path": path.name})
        self._writer.write_batch(batch)
        self._rows += len(batch)
        self._bytes += batch.nbytes
        if self._bytes >= self.shard_bytes:
            self.close_shard()

    def close_shard(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        shard = self.shards[-1]
        path = self.out / shard["path"]
        shard.update(num_rows=self._rows, bytes=path.stat().st_size, crc32=file_crc32(path))
        self._writer, self._rows, self._bytes = None, 0, 0


def ingest(cfg: IngestConfig) -> dict[str, Any]:
    """Convert ``cfg.sources`` into a dataset at ``cfg.out``; returns the manifest."""
    out = cfg.out
    if out.exists() and any(out.iterdir()):
        raise IngestError(f"{out} exists and is not empty; choose a new --out or remove it")
    for src in cfg.sources:
        if not src.is_file():
            raise IngestError(f"{src}: no such file")
        _source_kind(src)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    created = [d for d in [out.parent, *out.parent.parents] if not d.exists()]  # removed on refusal
    staging.mkdir(parents=True)
    done = False
    try:
        normalise = _Normaliser(cfg)
        writer = _ShardWriter(staging, cfg.shard_bytes)
        total = sum(s.stat().st_size for s in cfg.sources)
        with tqdm(total=total, unit="B", unit_scale=True, desc="ingest", disable=not cfg.progress) as bar:
            for src in cfg.sources:
                kind = _source_kind(src)
                gen = _jsonl_batches(src, cfg, bar) if kind == "jsonl" else _columnar_batches(src, kind, bar)
                for batch, where, first_row in gen:
                    writer.write(normalise(batch, where, first_row, kind == "jsonl"))
        writer.close_shard()
        num_samples = sum(s["num_rows"] for s in writer.shards)
        if normalise.schema is None or num_samples == 0:
            raise IngestError(
                f"{', '.join(str(s) for s in cfg.sources)}: no records (0 samples); "
                "a dataset needs at least one: check that these are the right source files"
            )
        manifest = {
            "format": FORMAT,
            "num_samples": num_samples,
            "columns": {f.name: str(f.type) for f in normalise.schema},
            "shards": writer.shards,
            "sources": [str(s) for s in cfg.sources],
        }
        (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1))
        if out.exists():
            out.rmdir()
        staging.rename(out)
        done = True
        return manifest
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if not done:
            for d in created:  # innermost first; only folders this call made and left empty
                try:
                    d.rmdir()
                except OSError:
                    break
