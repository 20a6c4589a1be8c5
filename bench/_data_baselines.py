"""Data-loading baselines for ``bench/data_path.py``: a plain torch DataLoader over local Arrow
shards, and mosaicml-streaming over the same data converted to MDS.

Input: Arrow IPC *file*-format shards with a ``tokens`` column of type
``fixed_size_list<int32, L>``; other columns are ignored. Every figure is GB/s (1e9 bytes) of
token bytes delivered to the training loop for one full shuffled epoch, timed from ``iter(loader)``
(worker start-up included) to the last batch, each batch copied into a preallocated tensor so
every byte is touched.

Install the peer exactly as /work/shared/BASELINES.md says (keeps the CPU torch):
``echo 'torch==2.13.0+cpu' > /tmp/c.txt && pip install -c /tmp/c.txt mosaicml-streaming``.
"""

from __future__ import annotations

import functools
import importlib.machinery
import os
import sys
import tempfile
import time
import types
import warnings
from collections.abc import Iterable

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import DataLoader, Dataset

# Rows handed out straight from a read-only mmap are never written; torch only warns that it
# could not guarantee that. Filters set here are inherited by the forked loader workers.
_READONLY_WARNING = r"The given (NumPy array|buffer) is not writable"


def _token_blocks(path: str) -> list[np.ndarray]:
    """Zero-copy ``(rows, L)`` int32 views of every record batch of one memory-mapped shard."""
    reader = pa.ipc.open_file(pa.memory_map(path, "r"))
    blocks = []
    for i in range(reader.num_record_batches):
        col = reader.get_batch(i).column("tokens")
        # flatten() (unlike .values) honours slice offsets of the list array.
        flat = col.flatten().to_numpy(zero_copy_only=True)
        blocks.append(flat.reshape(len(col), col.type.list_size))
    return blocks


class ArrowTokens(Dataset[torch.Tensor]):
    """Map-style dataset of ``tokens`` rows over local Arrow shards.

    The shards are only measured (row counts) in the constructor; each worker memory-maps them
    on first access, so nothing large is inherited or pickled.
    """

    def __init__(self, shard_paths: Iterable[str]) -> None:
        self.paths = list(shard_paths)
        # Views are dropped at once so that forked workers inherit no mapping.
        blocks = [b for p in self.paths for b in _token_blocks(p)]
        self.row_len = int(blocks[0].shape[1])
        self.starts = np.cumsum([0] + [len(b) for b in blocks], dtype=np.int64)
        self._blocks: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _views(self) -> list[np.ndarray]:
        if self._blocks is None:
            self._blocks = [b for p in self.paths for b in _token_blocks(p)]
        return self._blocks

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        # Batched lookup (torch >= 2.0 calls this once per batch): one vectorised searchsorted
        # instead of one per row. Rows stay views of the mmap; default_collate's stack is the
        # single copy, straight into the shared-memory tensor sent to the main process.
        blocks = self._views()
        idx = np.asarray(indices, dtype=np.int64)
        which = np.searchsorted(self.starts, idx, side="right") - 1
        rows = idx - self.starts[which]
        return [torch.from_numpy(blocks[b][r]) for b, r in zip(which.tolist(), rows.tolist())]


def _consume(loader: Iterable[torch.Tensor], batch_size: int, row_len: int) -> float:
    """Iterate one epoch, copying each batch into a preallocated tensor; return GB/s."""
    buf = torch.zeros(batch_size, row_len, dtype=torch.int32)  # pre-faulted: no page faults timed
    nbytes = 0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_READONLY_WARNING)
        t0 = time.perf_counter()
        for batch in loader:
            buf[: batch.shape[0]].copy_(batch)
            nbytes += batch.numel() * batch.element_size()
        elapsed = time.perf_counter() - t0
    return nbytes / elapsed / 1e9


def torch_dataloader_local_gbps(shard_paths: list[str], batch_size: int, num_workers: int = 2, seed: int = 0) -> float:
    """GB/s of one shuffled epoch through ``torch.utils.data.DataLoader`` over local Arrow shards.

    The variant a competent user writes today: a map-style :class:`ArrowTokens` (``pa.memory_map``
    + ``pa.ipc.open_file``, opened lazily per worker, batched ``__getitems__``), a seeded
    ``RandomSampler`` (``shuffle=True`` + generator), ``default_collate`` producing an int32
    ``(batch, L)`` tensor, no pinning (CPU only).
    """
    ds = ArrowTokens(shard_paths)
    loader = DataLoader(
        ds,
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
        num_workers=num_workers,
    )
    return _consume(loader, batch_size, ds.row_len)


def _import_streaming() -> types.ModuleType:
    """Import ``streaming`` beside the CPU torch.

    PyPI's torchvision does not match torch 2.13.0+cpu and dies on import (``operator
    torchvision::nms does not exist``); streaming only imports it for its vision datasets, so
    stand-ins suffice. They carry a ``__spec__`` because transformers (imported by streaming)
    probes ``importlib.util.find_spec("torchvision")``. Note they stay in ``sys.modules``.
    """
    if "streaming" not in sys.modules and "torchvision" not in sys.modules:

        class VisionDataset:  # base class streaming.vision subclasses; never instantiated here
            pass

        for name in ("torchvision", "torchvision.datasets", "torchvision.transforms", "torchvision.transforms.functional"):
            mod = types.ModuleType(name)
            mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
            sys.modules[name] = mod
        sys.modules["torchvision.datasets"].VisionDataset = VisionDataset
        sys.modules["torchvision.transforms.functional"].to_tensor = None
    import streaming

    return streaming


def write_mds(shard_paths: list[str], out_dir: str) -> None:
    """Convert the ``tokens`` column of the Arrow shards to MDS in ``out_dir``, uncompressed.

    Encoding ``ndarray:int32:L``: with dtype and shape fixed it is a fixed-size column, so MDS
    stores the raw 4*L bytes with no per-sample size header and decodes with a zero-copy
    ``np.frombuffer`` -- as cheap as ``bytes`` but self-describing and size-checked.
    """
    from tqdm import tqdm

    streaming = _import_streaming()
    blocks = [b for p in shard_paths for b in _token_blocks(p)]
    row_len = blocks[0].shape[1]
    columns = {"tokens": f"ndarray:int32:{row_len}"}
    total = sum(len(b) for b in blocks)
    with streaming.MDSWriter(out=out_dir, columns=columns) as writer, tqdm(total=total, unit="row", desc="MDS", mininterval=1.0) as bar:
        for block in blocks:
            for row in block:
                writer.write({"tokens": row})
            bar.update(len(block))


@functools.cache
def _token_stream_class(streaming: types.ModuleType) -> type:
    """StreamingDataset whose samples are int32 tensors (built lazily: streaming is optional)."""

    class TokenStream(streaming.StreamingDataset):  # type: ignore[name-defined]
        def get_item(self, sample_id: int, retry: int = 7) -> torch.Tensor:
            return torch.from_numpy(super().get_item(sample_id, retry)["tokens"])

    return TokenStream


def _release_streaming_state(streaming: types.ModuleType, prefix: int | None) -> None:
    """Free what a StreamingDataset leaves behind, so the next one in this process starts clean.

    Its shared memory is otherwise unlinked only at interpreter exit, and its filelocks in the
    temp dir are never removed -- while they exist every later dataset skips that prefix, which
    clean_stale_shared_memory() (it stops at the first clean prefix) then never reaches.
    """
    from streaming.base.constant import BARRIER_FILELOCK, CACHE_FILELOCK

    if prefix is not None:
        for name in (BARRIER_FILELOCK, CACHE_FILELOCK):
            path = os.path.join(tempfile.gettempdir(), f"{prefix:06}_{name}")
            if os.path.exists(path):
                os.remove(path)
    streaming.base.util.clean_stale_shared_memory()


def mosaic_streaming_gbps(mds_dir: str, batch_size: int, num_workers: int = 2, seed: int = 0) -> float:
    """GB/s of one shuffled epoch through mosaicml-streaming over a local MDS directory.

    ``StreamingDataset(local=mds_dir, shuffle=True, shuffle_seed=seed, batch_size=batch_size)``,
    otherwise defaults (py1e shuffle, predownload = 8 * batch_size, which makes throughput
    depend on batch_size), decoding each sample to an int32 tensor, in a
    ``StreamingDataLoader`` with ``num_workers``; default collate. Not safe to run while another
    process on the machine uses streaming: the cleanup unlinks streaming's /dev/shm entries.
    """
    streaming = _import_streaming()
    _release_streaming_state(streaming, None)  # leftovers of an earlier crashed run
    prefix: int | None = None
    try:
        ds = _token_stream_class(streaming)(local=mds_dir, shuffle=True, shuffle_seed=seed, batch_size=batch_size)
        prefix = ds._shm_prefix_int
        loader = streaming.StreamingDataLoader(ds, batch_size=batch_size, num_workers=num_workers)
        shard = ds.shards[0]
        encoding = shard.column_encodings[shard.column_names.index("tokens")]
        row_len = int(encoding.split(":")[-1])  # "ndarray:int32:L", as write_mds chose
        return _consume(loader, batch_size, row_len)
    finally:
        _release_streaming_state(streaming, prefix)


def _write_arrow_shards(out_dir: str, total_bytes: int, row_len: int, rows_per_shard: int) -> list[str]:
    """Random token shards (plus an ignored column) in Arrow IPC file format."""
    rng = np.random.default_rng(0)
    n_rows = total_bytes // (4 * row_len)
    paths: list[str] = []
    for start in range(0, n_rows, rows_per_shard):
        n = min(rows_per_shard, n_rows - start)
        tokens = rng.integers(0, 50_000, size=n * row_len, dtype=np.int32)
        table = pa.table(
            {
                "tokens": pa.FixedSizeListArray.from_arrays(pa.array(tokens), row_len),
                "doc_id": pa.array(np.arange(start, start + n)),
            }
        )
        path = os.path.join(out_dir, f"shard-{len(paths):05}.arrow")
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
            w.write_table(table, max_chunksize=1024)  # several record batches per shard
        paths.append(path)
    return paths


def _streaming_leftovers() -> list[str]:
    """streaming's own /dev/shm entries and temp-dir filelocks ("000000_barrier", ...)."""
    names = os.listdir("/dev/shm") + os.listdir(tempfile.gettempdir())
    return sorted(n for n in names if n[:6].isdigit() and n[6:7] == "_")


def _main() -> None:
    with tempfile.TemporaryDirectory(prefix="ffplane-data-baselines-") as tmp:
        paths = _write_arrow_shards(tmp, 200 * 2**20, row_len=2048, rows_per_shard=4096)
        size_gb = sum(os.path.getsize(p) for p in paths) / 1e9
        print(f"{len(paths)} Arrow shards, {size_gb:.3f} GB")
        for workers in (0, 2):
            gbps = torch_dataloader_local_gbps(paths, batch_size=64, num_workers=workers)
            print(f"torch DataLoader, {workers} workers: {gbps:.3f} GB/s")
        mds = os.path.join(tmp, "mds")
        t0 = time.perf_counter()
        write_mds(paths, mds)  # includes the one-time `import streaming` (~2.5 s)
        print(f"MDS conversion: {time.perf_counter() - t0:.1f} s")
        for workers in (0, 2, 2):  # the repeat checks that a second dataset works in-process
            gbps = mosaic_streaming_gbps(mds, batch_size=64, num_workers=workers)
            print(f"mosaicml-streaming, {workers} workers: {gbps:.3f} GB/s")
    print("streaming leftovers in /dev/shm and temp dir:", _streaming_leftovers() or "none")


if __name__ == "__main__":
    _main()
