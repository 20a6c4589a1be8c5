from __future__ import annotations

import re
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dataserver.ingest import IngestConfig, ingest
from tests._servers import TOKEN, Proc, start

if TYPE_CHECKING:
    from ffplane_harness.etcd_cluster import EtcdCluster
    from ffplane_harness.local_cluster import LocalCluster
    from ffplane_harness.netns import Netns

SEQ_LEN = 16


def write_token_parquet(path: Path, n: int, seq_len: int = SEQ_LEN, seed: int = 0) -> np.ndarray:
    """A tokenised-text source: row i is ``seq_len`` int token ids derived from i."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, size=(n, seq_len), dtype=np.int64)
    tokens[:, 0] = np.arange(n)  # makes every row unique and traceable to its index
    pq.write_table(pa.table({"tokens": pa.array(list(tokens))}), path)
    return tokens


def write_image_arrow(path: Path, n: int, seed: int = 1) -> list[bytes]:
    """Variable-length binary samples with a label, like encoded images."""
    rng = np.random.default_rng(seed)
    blobs = [i.to_bytes(4, "little") + rng.bytes(int(rng.integers(1, 300))) for i in range(n)]
    table = pa.table({"image": pa.array(blobs, pa.binary()), "label": pa.array(np.arange(n) % 10)})
    with pa.ipc.new_file(str(path), table.schema) as w:
        w.write_table(table, max_chunksize=37)  # many record batches: exercises cross-chunk takes
    return blobs


def write_lmdb(path: Path, values: list[bytes], meta: dict[str, object] | None) -> None:
    """An LMDB environment in the documented key scheme (sample i under i as 8 big-endian bytes)."""
    import json

    import lmdb

    from dataserver._lmdb_dataset import META_KEY, sample_key

    env = lmdb.open(str(path), map_size=1 << 26)
    with env.begin(write=True) as txn:
        for i, v in enumerate(values):
            txn.put(sample_key(i), v)
        if meta is not None:
            txn.put(META_KEY, json.dumps(meta).encode())
    env.close()


# Tests that run several torch processes for 20-90 s each (.ci/run's --durations): under
# pytest-xdist (`-n 2`, as .ci/run runs the suite) they are one work unit, so two of them never
# share the machine's two cores; the other worker runs the light tests beside them. A scheduler of
# our own: xdist's `--dist loadgroup` reads its groups from test ids it rewrites, which pytest 9
# no longer lets it do.
_HEAVY_MODULES = {"test_ddp_bitwise", "test_demo", "test_fsdp2", "test_link_hints", "test_node_loss", "test_rendezvous", "test_soak"}
_HEAVY_TESTS = {"tests/bench/test_bench_smoke.py::test_peers_smoke", "tests/bench/test_bench_smoke.py::test_step_cost_smoke"}


def heavy(nodeid: str) -> bool:
    path = nodeid.partition("::")[0]
    return Path(path).stem in _HEAVY_MODULES or nodeid.partition("[")[0] in _HEAVY_TESTS


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class _HeavyTogether(LoadScopeScheduling):
        """Every heavy test in one scope (scheduled first: scopes go largest first), every other its own."""

        def _split_scope(self, nodeid: str) -> str:
            return "heavy" if heavy(nodeid) else nodeid

    return _HeavyTogether(config, log)


def make_datasets(work: Path) -> Path:
    """Two datasets under ``work/datasets``: ``tokens`` (300 rows of 16 int32) and ``images`` (250 binary rows)."""
    root = work / "datasets"
    root.mkdir()
    write_token_parquet(work / "tokens.parquet", 300)
    ingest(IngestConfig([work / "tokens.parquet"], root / "tokens", shard_bytes=4096, progress=False))
    write_image_arrow(work / "images.arrow", 250)
    ingest(IngestConfig([work / "images.arrow"], root / "images", shard_bytes=8192, progress=False))
    return root


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return make_datasets(tmp_path)


@pytest.fixture
def dataserver(tmp_path: Path, data_dir: Path) -> Iterator[Proc]:
    proc = start("dataserver", ["serve", "--data-dir", str(data_dir), "--port", "0"], tmp_path, "dataserver")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def shared_dataserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """One data server for a module's tests that neither stop nor restart it; each keeps to its
    own job and node names (``job``), so no test sees another's."""
    work = tmp_path_factory.mktemp("shared-dataserver")
    proc = start("dataserver", ["serve", "--data-dir", str(make_datasets(work)), "--port", "0"], work, "dataserver")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def job(request: pytest.FixtureRequest) -> str:
    """A job (or node) name of this test's own, for tests sharing a server."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", request.node.name)[:120]


@pytest.fixture
def shm_root() -> Iterator[Path]:
    """A fresh ffplane root on tmpfs, removed afterwards."""
    root = Path("/dev/shm") / f"ffplane-test-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def mounted_tmpfs(where: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``where`` (made if missing) with ``options``, unmounted after; the test
    is skipped where it cannot be mounted (not root)."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture
def huge_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs mounted ``huge=within_size`` (the recommended daemon root)."""
    with mounted_tmpfs(tmp_path / "huge", "size=512m,huge=within_size") as where:
        yield where


@contextmanager
def launcher(tmp_path: Path, module: str) -> Iterator[Callable[[list[str], str], Proc]]:
    """``launch(args, name)`` starts ``python -m module args`` (logs in ``tmp_path``); every
    process it started is killed on the way out, even on failure."""
    procs: list[Proc] = []

    def launch(args: list[str], name: str) -> Proc:
        procs.append(start(module, args, tmp_path, f"{name}{len(procs)}"))
        return procs[-1]

    try:
        yield launch
    finally:
        for p in procs:
            p.kill()


@pytest.fixture
def start_daemon(tmp_path: Path, dataserver: Proc, shm_root: Path) -> Iterator[Callable[..., Proc]]:
    """Start (and, by calling again, restart) the node daemon on ``shm_root``; stopped at the end."""
    with launcher(tmp_path, "statestore") as launch:

        def _start(*extra: str, root: Path = shm_root, name: str = "daemon") -> Proc:
            return launch(["serve", "--dataserver", dataserver.url, "--root", str(root), "--port", "0", "--budget-mb", "256", *extra], name)

        yield _start


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A real 3-member etcd cluster on loopback (skipped where etcd is not installed)."""
    from ffplane_harness.etcd_cluster import EtcdCluster, available

    if available():
        pytest.skip(str(available()))
    with EtcdCluster(tmp_path) as cluster:
        yield cluster


@pytest.fixture
def net() -> Iterator[Netns | None]:
    """Eight network namespaces on 1 Gbit/s links when root (data servers, training nodes and
    three etcd members — the last three — each on a node of their own), else None (everything on
    loopback); deleted afterwards, even on failure."""
    from ffplane_harness.netns import Netns, available, leftovers

    if available():
        yield None
        return
    n = Netns(8, rate="1gbit")
    try:
        yield n
    finally:
        n.close()
    assert not [x for x in leftovers() if x.startswith(n.tag)]


@pytest.fixture
def fail_first_copy(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """``arm()`` makes the next Checkpointer copy into a slot raise (then copies work again)."""
    from trainer_client import Checkpointer

    real = Checkpointer._copy
    calls = {"n": 0}

    def fail_once(self: Checkpointer, *a: object) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected copy failure")
        real(self, *a)  # type: ignore[arg-type]

    def arm() -> None:
        monkeypatch.setattr(Checkpointer, "_copy", fail_once)

    return arm


@contextmanager
def cluster_in(mode: str, tmp_path: Path, data_dir: Path, nodes: int, bind_all: bool = False) -> Iterator[LocalCluster]:
    """A LocalCluster on loopback, or on ``nodes`` network namespaces (1 Gbit/s links; skipped
    without root); the namespaces are deleted afterwards, even on failure, and checked gone.
    ``bind_all``: daemons listen on 0.0.0.0 and advertise their node's address."""
    from ffplane_harness.local_cluster import LocalCluster
    from ffplane_harness.netns import Netns, available, leftovers

    net = None
    if mode == "netns":
        if available():
            pytest.skip(str(available()))
        net = Netns(nodes, rate="1gbit")
    try:
        with LocalCluster(tmp_path, data_dir, TOKEN, net=net, bind_all=bind_all) as c:
            yield c
    finally:
        if net is not None:
            net.close()
    assert not [n for n in leftovers() if net is not None and n.startswith(net.tag)]


def create_job(ds: Proc, **overrides: object) -> dict[str, object]:
    body = {"name": "j1", "dataset": "tokens", "dp": 2, "batch_per_rank": 8, "seed": 5, "max_steps": 60}
    body.update(overrides)
    r = httpx.post(ds.url + "/v1/jobs", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code in (200, 201), r.text
    result: dict[str, object] = r.json()
    return result


__all__ = [
    "SEQ_LEN",
    "TOKEN",
    "cluster_in",
    "create_job",
    "launcher",
    "make_datasets",
    "write_image_arrow",
    "write_lmdb",
    "write_token_parquet",
]
