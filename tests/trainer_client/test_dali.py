"""The DALI source over the node cache: encoded images decoded by a real DALI pipeline (CPU here,
the ``mixed`` GPU decoder where a device is), in plan order, every sample once per epoch, resumed
from a position, partial batches kept."""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

from dataserver.ingest import IngestConfig, ingest
from tests._servers import TOKEN, Proc
from tests.conftest import create_job
from trainer_client import DataLoader

dali = pytest.importorskip("nvidia.dali", reason="the dali extra (nvidia-dali) is not installed")
fn = pytest.importorskip("nvidia.dali.fn")
types = pytest.importorskip("nvidia.dali.types")
from trainer_client.dali import CacheSource, DaliLoader  # noqa: E402  (after the skip)

N_IMAGES = 40


def _image(i: int) -> np.ndarray:
    """Image ``i``: its shape and colour say which sample it is."""
    return np.full((8 + i % 5, 8 + i % 3, 3), (i * 6) % 240, dtype=np.uint8)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """A ``jpegs`` dataset: JPEG-encoded images (variable length) with a label."""
    from PIL import Image

    blobs = []
    for i in range(N_IMAGES):
        out = io.BytesIO()
        Image.fromarray(_image(i)).save(out, format="JPEG", quality=95)
        blobs.append(out.getvalue())
    table = pa.table({"jpeg": pa.array(blobs, pa.binary()), "label": pa.array(np.arange(N_IMAGES) % 10)})
    with pa.ipc.new_file(str(tmp_path / "jpegs.arrow"), table.schema) as w:
        w.write_table(table, max_chunksize=9)
    root = tmp_path / "datasets"
    ingest(IngestConfig([tmp_path / "jpegs.arrow"], root / "jpegs", shard_bytes=4096, progress=False))
    return root


@pytest.fixture
def served(dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path) -> Iterator[dict[str, Any]]:
    create_job(dataserver, name="jpg", dataset="jpegs", dp=2, batch_per_rank=6, max_steps=10)  # 3 epochs of 40
    start_daemon()
    yield {"dataserver": dataserver.url, "token": TOKEN, "socket_path": shm_root / "daemon.sock"}


def _pipeline(source: CacheSource, batch_size: int, device: str = "cpu") -> Any:
    @dali.pipeline_def(batch_size=batch_size, num_threads=1, device_id=0 if device == "mixed" else None, prefetch_queue_depth=2)
    def images() -> Any:
        jpegs, labels, index = fn.external_source(
            source=source, num_outputs=3, batch=True, no_copy=True, dtype=[types.UINT8, types.INT64, types.INT64]
        )
        return fn.decoders.image(jpegs, device=device), labels, index

    return images()


def _read(loader: DaliLoader, limit: int | None = None) -> list[tuple[list[np.ndarray], list[int], list[int]]]:
    out = []
    for images, labels, index in loader:
        if hasattr(images, "as_cpu"):  # the mixed decoder's output lives on the GPU
            images = images.as_cpu()
        rows = range(len(images))
        out.append(([np.array(images.at(i)) for i in rows], [int(labels.at(i)) for i in rows], [int(index.at(i)) for i in rows]))
        if limit is not None and len(out) == limit:
            break
    return out


def _check_decoded(batches: list[tuple[list[np.ndarray], list[int], list[int]]]) -> None:
    for images, labels, index in batches:
        for img, label, i in zip(images, labels, index):
            assert img.shape == _image(i).shape and label == i % 10
            assert abs(float(img.mean()) - float(_image(i).mean())) < 3  # JPEG is lossy, not that lossy


def test_dali_decodes_each_ranks_batches_in_plan_order_exactly_once(served: dict[str, Any]) -> None:
    steps = {}
    for rank in range(2):
        source = CacheSource("jpg", rank, columns=("jpeg", "label", "_sample_index"), **served)
        loader = DaliLoader(_pipeline(source, source.rows_per_batch), source)
        steps[rank] = _read(loader)
        loader.close()
        plain = [b["_sample_index"].tolist() for b in DataLoader("jpg", rank, **served)]
        assert [index for _, _, index in steps[rank]] == plain  # the plan's order, step by step
        _check_decoded(steps[rank])
    assert len(steps[0]) == len(steps[1]) == 10
    stream = [i for s in range(10) for rank in range(2) for i in steps[rank][s][2]]
    for epoch in range(3):
        assert Counter(stream[epoch * N_IMAGES : (epoch + 1) * N_IMAGES]) == Counter(range(N_IMAGES))


def test_dali_resumes_at_a_position_and_keeps_partial_batches(served: dict[str, Any]) -> None:
    options = {**served, "micro_batches": 4}  # 6 rows a step → micro-batches of 1, 2, 1, 2 rows

    def loader_at(state: dict[str, Any] | None = None) -> DaliLoader:
        source = CacheSource("jpg", 1, columns=("jpeg", "label", "_sample_index"), **options)
        assert source.rows_per_batch == 2
        loader = DaliLoader(_pipeline(source, source.rows_per_batch), source)
        if state is not None:
            loader.load_state_dict(state)
        return loader

    whole = loader_at()
    everything = _read(whole)
    whole.close()
    assert [len(index) for _, _, index in everything[:4]] == [1, 2, 1, 2]  # the short ones are not dropped
    assert sum(len(index) for _, _, index in everything) == 10 * 6

    first = loader_at()
    head = _read(first, limit=3 * 4)  # three whole steps
    state = first.state_dict()
    assert state["next_step"] == 3 and state["kind"] == "ffplane.DataLoader"
    with pytest.raises(Exception, match="after iterating"):
        first.load_state_dict(state)
    first.close()
    resumed = loader_at(state)
    tail = _read(resumed)
    resumed.close()
    assert [b[2] for b in head + tail] == [b[2] for b in everything]  # nothing lost, nothing twice
    _check_decoded(tail)


def test_a_batch_larger_than_the_pipeline_is_refused_by_size(served: dict[str, Any]) -> None:
    source = CacheSource("jpg", 0, columns=("jpeg", "label", "_sample_index"), **served)
    loader = DaliLoader(_pipeline(source, 4), source)  # the job's steps have 6 rows
    with pytest.raises(Exception, match="more than the pipeline's batch_size=4"):
        _read(loader)
    loader.close()
    with pytest.raises(ValueError, match="decode and move data inside the pipeline"):
        CacheSource("jpg", 0, columns=("jpeg",), device="cuda", **served)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_mixed_gpu_decoder_reads_the_node_cache(served: dict[str, Any]) -> None:
    source = CacheSource("jpg", 0, columns=("jpeg", "label", "_sample_index"), **served)
    loader = DaliLoader(_pipeline(source, source.rows_per_batch, device="mixed"), source)
    batches = _read(loader)
    loader.close()
    assert len(batches) == 10
    _check_decoded(batches)
