"""One exactly-once test that every served dataset form must pass (Arrow tokens, Arrow binary,
LMDB fixed-width, LMDB binary), through the real server and an elastic dp change."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pytest

from dataserver.catalog import SAMPLE_INDEX_COLUMN
from tests._servers import TOKEN, Proc, start
from tests.conftest import write_lmdb

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def server_with_lmdb(tmp_path: Path, data_dir: Path) -> Iterator[Proc]:
    n = 230
    write_lmdb(
        data_dir / "lmdb_tokens",
        [np.full(8, i, dtype=np.int32).tobytes() for i in range(n)],
        {"num_samples": n, "column": "tokens", "dtype": "int32", "shape": [8]},
    )
    write_lmdb(data_dir / "lmdb_blobs", [i.to_bytes(4, "little") * (1 + i % 5) for i in range(n)], None)
    proc = start("dataserver", ["serve", "--data-dir", str(data_dir), "--port", "0"], tmp_path, "ds-formats")
    try:
        yield proc
    finally:
        proc.stop()


def _row_id(batch: pa.RecordBatch, dataset: str) -> list[int]:
    """Each form encodes the dataset index in its bytes; decode it back."""
    if dataset in ("tokens", "lmdb_tokens"):
        return batch.column(batch.schema.names[0]).values.to_numpy().reshape(len(batch), -1)[:, 0].tolist()
    col = "image" if dataset == "images" else "data"
    return [int.from_bytes(b[:4], "little") for b in batch.column(col).to_pylist()]


@pytest.mark.parametrize(("dataset", "n"), [("tokens", 300), ("images", 250), ("lmdb_tokens", 230), ("lmdb_blobs", 230)])
def test_every_form_serves_each_sample_once_per_epoch(server_with_lmdb: Proc, dataset: str, n: int) -> None:
    url = server_with_lmdb.url
    job = {"name": f"eo-{dataset}", "dataset": dataset, "dp": 2, "batch_per_rank": 7, "seed": 11, "max_steps": 200}
    assert httpx.post(url + "/v1/jobs", json=job, headers=AUTH).status_code == 201
    gen = {"start_step": 5, "dp": 3, "batch_per_rank": 5}  # an elastic change mid-epoch
    assert httpx.post(url + f"/v1/jobs/{job['name']}/generations", json=gen, headers=AUTH).status_code == 200
    seen: list[int] = []
    step = 0
    while len(seen) < n:
        dp = 2 if step < 5 else 3
        for rank in range(dp):
            r = httpx.get(url + f"/v1/jobs/{job['name']}/batches", params={"dp_rank": rank, "start": step}, headers=AUTH)
            assert r.status_code == 200, r.text
            batch = pa.ipc.open_stream(r.content).read_next_batch()
            ids = batch.column(SAMPLE_INDEX_COLUMN).to_pylist()
            assert _row_id(batch, dataset) == ids  # the bytes are the sample the plan names
            seen.extend(ids)
        step += 1
    assert Counter(seen[:n]) == Counter(range(n))
