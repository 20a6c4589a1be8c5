"""The contract every shard transport passes (``statestore.transport.Transport``): HTTP today, and
whatever comes next (RDMA, sendfile) is added to ``TRANSPORTS``.

Two real daemons on loopback (``--no-replicate``: nothing moves between them but what a test
sends) face a client of the transport in this process, whose own shards live in a slot and
replica store of its own. What arrives is checked on the daemons' disks and in their
``/v1/state``, not through the transport under test.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from ffplane_contract.checksum import checksum
from ffplane_contract.errors import FFPlaneError
from ffplane_harness.local_cluster import LocalCluster, Proc
from statestore.budget import Budget
from statestore.index import Index
from statestore.link_gate import GateConfig, LinkGate
from statestore.replicas import ReplicaStore
from statestore.shard import LocalShard, find_local
from statestore.slots import SlotStore
from statestore.transport import BulkTransport, HttpTransport, PeerError, Transport
from tests._servers import TOKEN
from tests.statestore.conftest import daemon_state, start_ring
from trainer_client import Checkpointer

JOB, ROLE = "job", "dp0-pp0-tp0"
CHUNK = 64 << 10


@dataclass(frozen=True)
class _Kind:
    """A transport under test: its client, and how it addresses a daemon."""

    make: Callable[[LinkGate, str | None], Transport]
    address: Callable[[Proc], str]  # where a running daemon takes this transport
    nowhere: Callable[[], str]  # an address nothing answers at


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


TRANSPORTS = [
    pytest.param(_Kind(HttpTransport, lambda d: d.url, lambda: f"http://127.0.0.1:{_closed_port()}"), id="http"),
    # pushes on the daemons' bulk ports (found through their HTTP address), the rest over HTTP
    pytest.param(_Kind(BulkTransport, lambda d: d.url, lambda: f"http://127.0.0.1:{_closed_port()}"), id="bulk"),
]


@pytest.fixture(params=TRANSPORTS)
def kind(request: pytest.FixtureRequest) -> _Kind:
    k: _Kind = request.param
    return k


@pytest.fixture
def pair(cluster: LocalCluster) -> LocalCluster:
    start_ring(cluster, 2, "--no-replicate")
    return cluster


@dataclass
class _Here:
    """This process as a node: its stores and the transport's client."""

    slots: SlotStore
    replicas: ReplicaStore
    transport: Transport

    async def hold(self, role: str, step: int, data: bytes) -> LocalShard:
        """``data`` as a committed replica here, a shard the transport may push."""
        self.replicas.begin(JOB, role, step, len(data), checksum(data), {"layout_roles": [role]}, "elsewhere")
        await self.replicas.write(JOB, role, step, 0, data)
        await self.replicas.finish(JOB, role, step)
        shard = find_local(self.slots, self.replicas, JOB, role, step)
        assert shard is not None
        return shard


@asynccontextmanager
async def _here(kind: _Kind, root: Path, token: str | None = TOKEN) -> AsyncIterator[_Here]:
    root.mkdir(exist_ok=True)
    index = Index(root)
    budget = Budget(1 << 30)
    slots = SlotStore(root, index, budget)
    replicas = ReplicaStore(root, index, budget)
    gate = LinkGate(GateConfig(chunk_bytes=CHUNK), root)
    transport = kind.make(gate, token)
    await transport.start()
    try:
        yield _Here(slots, replicas, transport)
    finally:
        await transport.close()
        gate.close()
        replicas.close()
        slots.close()
        index.close()


def _run(kind: _Kind, root: Path, body: Callable[[_Here], Awaitable[None]], token: str | None = TOKEN) -> None:
    async def main() -> None:
        async with _here(kind, root, token) as here:
            await body(here)

    asyncio.run(main())


def _data(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _replicas_on(c: LocalCluster, node: int, role: str) -> list[dict[str, Any]]:
    return [r for r in daemon_state(c, node)["replicas"] if r["job"] == JOB and r["role"] == role]


def _replica_file(c: LocalCluster, node: int, role: str, step: int) -> Path:
    return c.roots[node] / JOB / "replica" / role / f"{step:012d}.bin"


def test_a_pushed_shard_arrives_bitwise_and_verified(kind: _Kind, pair: LocalCluster, tmp_path: Path) -> None:
    data = _data(5 * CHUNK + 1234, seed=1)  # several chunks and a tail
    to = kind.address(pair.daemons[1])
    sent: list[int] = []

    async def body(here: _Here) -> None:
        shard = await here.hold("dp7-pp0-tp0", 9, data)
        sent.append(await here.transport.push(to, shard, "sender", newest=9))
        # sent again after a ring change: the receiver holds it whole, so nothing moves
        sent.append(await here.transport.push(to, shard, "sender", newest=9, maybe_there=True))

    _run(kind, tmp_path / "here", body)
    assert sent == [len(data), 0]
    held = _replicas_on(pair, 1, "dp7-pp0-tp0")
    assert held == [
        {"job": JOB, "role": "dp7-pp0-tp0", "step": 9, "nbytes": len(data), "checksum": checksum(data), "from": "sender", "kind": "replica"}
    ]
    assert _replica_file(pair, 1, "dp7-pp0-tp0", 9).read_bytes() == data


def test_a_pull_brings_a_shard_back_bitwise(kind: _Kind, pair: LocalCluster, tmp_path: Path) -> None:
    ck = Checkpointer(JOB, socket_path=pair.socket(0))
    for step in (1, 2):
        ck.save(step, {"w": torch.randn(300, 257, generator=torch.Generator().manual_seed(step)), "step": step})
    ck.close()
    versions = {v["step"]: v for v in daemon_state(pair, 0)["roles"][0]["versions"]}
    on_disk = {s: (pair.roots[0] / v["slot"]).read_bytes()[: v["nbytes"]] for s, v in versions.items()}
    from_ = kind.address(pair.daemons[0])
    got: dict[str, Any] = {}

    async def body(here: _Here) -> None:
        got["meta"] = await here.transport.shard_meta(from_, JOB, ROLE, 2)
        r = got["replica"] = await here.transport.pull(from_, here.replicas, JOB, ROLE, 2, "n0")
        got["bytes"] = (here.replicas.root / r.path).read_bytes()
        got["held"] = here.replicas.get(JOB, ROLE, 2) is r

    _run(kind, tmp_path / "here", body)
    meta, r = got["meta"], got["replica"]
    assert (meta.nbytes, meta.checksum, meta.kind) == (versions[2]["nbytes"], versions[2]["checksum"], "primary")
    assert got["bytes"] == on_disk[2] and r.checksum == checksum(on_disk[2]) == meta.checksum
    assert (r.kind, r.source, got["held"]) == ("pulled", "n0", True)


def test_damaged_bytes_are_refused_and_nothing_counts(kind: _Kind, pair: LocalCluster, tmp_path: Path) -> None:
    """Pushed: the receiver finds the bytes fail the checksum they were sent with (422) and keeps
    nothing. Pulled: a holder's copy damaged on its way here is refused the same way."""
    data = _data(3 * CHUNK + 77, seed=2)
    damaged = bytearray(data)
    damaged[len(data) // 2] ^= 0xFF
    to, from_ = kind.address(pair.daemons[1]), kind.address(pair.daemons[0])
    ck = Checkpointer(JOB, socket_path=pair.socket(0))
    ck.save(4, {"w": torch.randn(200, 129, generator=torch.Generator().manual_seed(4))})
    ck.close()
    version = daemon_state(pair, 0)["roles"][0]["versions"][0]
    with open(pair.roots[0] / version["slot"], "r+b") as f:  # n0's only copy, as if hit on the way
        f.seek(version["nbytes"] // 3)
        f.write(b"\xff" * 16)
    errors: dict[str, Any] = {}

    async def body(here: _Here) -> None:
        shard = await here.hold("dp7-pp0-tp0", 5, bytes(damaged))
        wrong = dataclasses.replace(shard, checksum=checksum(data))  # what the bytes were before
        with pytest.raises(PeerError) as pushed:
            await here.transport.push(to, wrong, "sender", newest=5)
        errors["push"] = pushed.value
        with pytest.raises(PeerError) as gone:  # nothing the receiver would hand out
            await here.transport.shard_meta(to, JOB, "dp7-pp0-tp0", 5)
        errors["meta"] = gone.value
        with pytest.raises(FFPlaneError) as pulled:  # found by the store it lands in
            await here.transport.pull(from_, here.replicas, JOB, ROLE, 4, "n0")
        errors["pull"] = pulled.value
        errors["pulled_here"] = here.replicas.get(JOB, ROLE, 4), list(here.replicas.root.glob(f"{JOB}/replica/{ROLE}/*"))

    _run(kind, tmp_path / "here", body)
    assert errors["push"].status == 422 and not errors["push"].unreachable
    assert _replicas_on(pair, 1, "dp7-pp0-tp0") == []  # neither counted nor still incoming
    assert not _replica_file(pair, 1, "dp7-pp0-tp0", 5).exists()
    assert errors["meta"].status == 404
    assert errors["pull"].status == 422
    assert errors["pulled_here"] == (None, [])


def test_a_push_older_than_the_receivers_newest(kind: _Kind, pair: LocalCluster, tmp_path: Path) -> None:
    """An older step is taken and kept beside the newer ones (a restore may want it); a sender
    whose newest step is below what the receiver holds rewound, and those are dropped."""
    role = "dp7-pp0-tp0"
    to = kind.address(pair.daemons[1])
    blobs = {s: _data(2 * CHUNK + s, seed=s) for s in (3, 4, 5, 6)}
    held: list[list[int]] = []

    async def body(here: _Here) -> None:
        for step, newest in ((5, 5), (6, 6), (4, 6)):  # held here just before: this store keeps two versions too
            assert await here.transport.push(to, await here.hold(role, step, blobs[step]), "sender", newest=newest) == len(blobs[step])
        held.append(sorted(r["step"] for r in _replicas_on(pair, 1, role)))
        await here.transport.push(to, await here.hold(role, 3, blobs[3]), "sender", newest=3)
        held.append(sorted(r["step"] for r in _replicas_on(pair, 1, role)))

    _run(kind, tmp_path / "here", body)
    assert held == [[4, 5, 6], [3]]
    assert _replica_file(pair, 1, role, 3).read_bytes() == blobs[3]


def test_an_unreachable_peer_is_told_apart_from_a_refusal(kind: _Kind, pair: LocalCluster, tmp_path: Path) -> None:
    nowhere, there = kind.nowhere(), kind.address(pair.daemons[1])
    errors: list[PeerError] = []

    async def body(here: _Here) -> None:
        shard = await here.hold("dp7-pp0-tp0", 1, _data(CHUNK, seed=3))
        calls: list[Callable[[], Awaitable[Any]]] = [
            lambda: here.transport.push(nowhere, shard, "sender", newest=1),
            lambda: here.transport.shard_meta(nowhere, JOB, ROLE, 1),
            lambda: here.transport.pull(nowhere, here.replicas, JOB, ROLE, 1, "n9"),
        ]
        for call in calls:
            with pytest.raises(PeerError) as exc:
                await call()
            errors.append(exc.value)

    _run(kind, tmp_path / "here", body)
    assert [(e.unreachable, e.status) for e in errors] == [(True, 502)] * 3

    refused: list[PeerError] = []

    async def wrong_token(here: _Here) -> None:
        shard = await here.hold("dp7-pp0-tp0", 1, _data(CHUNK, seed=3))
        with pytest.raises(PeerError) as exc:
            await here.transport.push(there, shard, "sender", newest=1)
        refused.append(exc.value)

    _run(kind, tmp_path / "other", wrong_token, token="not-the-job-token")
    assert (refused[0].unreachable, refused[0].status) == (False, 401)
