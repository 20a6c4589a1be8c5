"""``dataserver ingest``: JSONL, JSONL.GZ, Parquet and Arrow sources → an ffplane Arrow dataset.

The served form is a directory with Arrow IPC *file* shards (memory-mappable, random access) and
``manifest.json`` (format, row count, each shard's rows, bytes and CRC-32). Lists of integers
whose length is the same in every row (token ids) become ``fixed_size_list`` columns so that
readers get them zero-copy as a 2-D tensor. Nothing is written to ``--out`` unless every record
of every source is valid: the dataset is built in a sibling folder and renamed into place.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from dataserver._arrow_dataset import FORMAT, MANIFEST_NAME, file_crc32

_ROWS_PER_BATCH = 4096


class IngestError(Exception):
    """A source record is malformed; the message names the file and the line or row."""


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
    raise IngestError(
        f"{path}: unknown source type; expected .jsonl, .jsonl.gz, .parquet or .arrow/.feather"
    )


class _Normaliser:
    """Makes every batch match the first one's schema, fixing list widths to fixed-size lists."""

    def __init__(self, cfg: IngestConfig) -> None:
        self.cfg = cfg
        self.schema: pa.Schema | None = None

    def __call__(self, batch: pa.RecordBatch, where: str, first_row: int, from_json: bool) -> pa.RecordBatch:
        if self.schema is None:
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
                    f"{where}: rows {first_row}..{first_row + len(batch) - 1}: column {f.name!r} "
                    f"does not convert to {f.type}: {exc}"
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



def _jsonl_batches(
    path: Path, cfg: IngestConfig, bar: tqdm
) -> Iterator[tuple[pa.RecordBatch, str, int]]:
    raw = open(path, "rb")
    stream: IO[bytes] = gzip.GzipFile(fileobj=raw) if path.name.lower().endswith(".gz") else raw  # type: ignore[assignment]
    rows: list[dict[str, Any]] = []
    keys: list[str] | None = None
    first_line = 1
    first_row = 0  # 0-based record number of the block's first row
    last_pos = 0
    with raw, stream:
        for lineno, line in enumerate(stream, start=1):
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
            elif sorted(rec) != keys:
                raise IngestError(f"{path}:{lineno}: fields {sorted(rec)} differ from the first record's {keys}")
            for name in cfg.binary_fields:
                try:
                    rec[name] = base64.b64decode(rec[name], validate=True)
                except (KeyError, TypeError, ValueError) as exc:
                    raise IngestError(f"{path}:{lineno}: field {name!r} is not base64: {exc}") from exc
            if not rows:
                first_line = lineno
            rows.append(rec)
            if len(rows) == _ROWS_PER_BATCH:
                yield _rows_to_batch(rows, path, first_line), str(path), first_row
                first_row += len(rows)
                rows = []
                pos = raw.tell()
                bar.update(pos - last_pos)
                last_pos = pos
    if rows:
        yield _rows_to_batch(rows, path, first_line), str(path), first_row
    bar.update(path.stat().st_size - last_pos)


def _rows_to_batch(rows: list[dict[str, Any]], path: Path, first_line: int) -> pa.RecordBatch:
    try:
        return pa.RecordBatch.from_pylist(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        # Find the offending line so the user can fix it without bisecting the file.
        for i in range(len(rows)):
            try:
                pa.RecordBatch.from_pylist(rows[: i + 1])
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                raise IngestError(f"{path}: record {i + 1} of the block starting at line {first_line}: {exc}") from exc
        raise IngestError(f"{path}: lines {first_line}..: {exc}") from exc


def _columnar_batches(
    path: Path, kind: str, bar: tqdm
) -> Iterator[tuple[pa.RecordBatch, str, int]]:
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
    staging.mkdir(parents=True)
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
        if normalise.schema is None:
            raise IngestError(f"no records in {[str(s) for s in cfg.sources]}")
        manifest = {
            "format": FORMAT,
            "num_samples": sum(s["num_rows"] for s in writer.shards),
            "columns": {f.name: str(f.type) for f in normalise.schema},
            "shards": writer.shards,
            "sources": [str(s) for s in cfg.sources],
        }
        (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1))
        if out.exists():
            out.rmdir()
        staging.rename(out)
        return manifest
    finally:
        shutil.rmtree(staging, ignore_errors=True)
