"""The bulk channel between daemons (``statestore.transport.bulk``), spoken to by hand: a cut-off push
resumes from what landed, damaged bytes never count, strangers are cut off, and a role's replica
files are reused. The transport contract (``test_transport.py``, id ``bulk``) covers the client."""

from __future__ import annotations

import signal
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import xxhash

from ffplane_contract.shard import header_digest, static_digest
from ffplane_harness.local_cluster import LocalCluster
from statestore.transport.bulk_wire import REPLY_HEAD_SIZE, BulkHead, BulkMeta, BulkReply, Op
from tests._servers import TOKEN, until
from tests.statestore.conftest import daemon_state, start_ring
from trainer_client import Checkpointer, Layout
from trainer_client.checkpointer import settle_all

AUTH = {"Authorization": f"Bearer {TOKEN}"}
DATA = bytes(range(256)) * 1024
ROLE = "dpX"


def bulk_port(c: LocalCluster, node: int) -> int:
    port: int = httpx.get(c.daemons[node].url + "/v1/transfer", headers=AUTH).json()["bulk_port"]
    return port


def connect(c: LocalCluster, node: int, token: str | None = TOKEN) -> socket.socket:
    """A connection to the node's bulk port, authenticated with ``token`` (None: not at all)."""
    sock = socket.create_connection(("127.0.0.1", bulk_port(c, node)), timeout=30)
    if token is not None:
        sock.sendall(BulkHead.hello(token))
        assert read_reply(sock).status == 200
    return sock


def meta(step: int, data: bytes = DATA, **static: Any) -> bytes:
    digest = xxhash.xxh3_64_hexdigest(data)
    header = {"tree": step} if static else {"layout_roles": [ROLE]}
    return BulkMeta("job", ROLE, step, len(data), digest, header, "elsewhere", newest=step, **static).pack()


def read_reply(sock: socket.socket) -> BulkReply:
    status, n = BulkReply.body_len(_read(sock, REPLY_HEAD_SIZE))
    return BulkReply.unpack(status, _read(sock, n))


def _ask(sock: socket.socket, op: Op, raw: bytes, offset: int = 0, body: bytes = b"") -> BulkReply:
    sock.sendall(BulkHead(op, len(raw), offset, len(body)).pack() + raw + body)
    return read_reply(sock)


def _read(sock: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        piece = sock.recv(n - len(got))
        if not piece:
            raise EOFError(f"closed after {len(got)} of {n} bytes")
        got += piece
    return got


def _ring_of_two(c: LocalCluster, *extra: str) -> None:
    """Two daemons, node 0 knowing node 1 as its successor (commits before that are not pushed)."""
    start_ring(c, 2, *extra)
    until(lambda: daemon_state(c, 0)["coordinator"].get("successor") == "n1", what="node 0 to know its successor")


def _replicas(c: LocalCluster, node: int) -> list[tuple[int, str]]:
    return sorted((r["step"], r["kind"]) for r in daemon_state(c, node)["replicas"] if r["role"] == ROLE)


def test_a_cut_push_resumes_from_what_landed_and_counts_only_once_verified(cluster: LocalCluster) -> None:
    start_ring(cluster, 1)
    with connect(cluster, 0) as s:  # the sender dies 100 kB in
        s.sendall(BulkHead(Op.PUSH, len(meta(7)), 0, len(DATA)).pack() + meta(7) + DATA[:100_000])
    until(lambda: any(r.get("received") == 100_000 for r in daemon_state(cluster, 0)["replicas"]), what="the cut push's bytes landed")
    assert _replicas(cluster, 0) == [(7, "incoming")]  # nothing counts yet
    with connect(cluster, 0) as s:
        assert _ask(s, Op.PROBE, meta(7)).received == 100_000
        wrong = _ask(s, Op.PUSH, meta(7), 0, DATA)  # from the start again: told where to resume, connection kept
        assert (wrong.status, wrong.received) == (409, 100_000)
        done = _ask(s, Op.PUSH, meta(7), 100_000, DATA[100_000:])
        assert (done.status, done.received, done.checksum) == (200, len(DATA), xxhash.xxh3_64_hexdigest(DATA))
        # bytes damaged on the way: refused, nothing kept, and the connection still takes the next push
        damaged = _ask(s, Op.PUSH, meta(8), 0, DATA[:-1] + b"\0")
        assert damaged.status == 422 and "checksum" in damaged.detail
        assert _ask(s, Op.PUSH, meta(9), 0, DATA).status == 200
    assert _replicas(cluster, 0) == [(7, "replica"), (9, "replica")]
    shard = httpx.get(cluster.daemons[0].url + f"/v1/state/job/{ROLE}/7/shard", headers=AUTH)
    assert shard.content == DATA


def test_a_cut_large_push_counts_every_byte_that_arrived(cluster: LocalCluster) -> None:
    """A receiver is woken for a MiB of a body at a time (SO_RCVLOWAT), not every segment: the
    bytes after the last whole MiB, followed by the sender's death, must still land and count."""
    start_ring(cluster, 1)
    big = DATA * 12  # 3 MiB: more than one wake-up's worth
    cut = 1_800_000
    with connect(cluster, 0) as s:
        s.sendall(BulkHead(Op.PUSH, len(meta(7, big)), 0, len(big)).pack() + meta(7, big) + big[:cut])
    until(lambda: any(r.get("received") == cut for r in daemon_state(cluster, 0)["replicas"]), what="the cut push's bytes landed")
    with connect(cluster, 0) as s:
        done = _ask(s, Op.PUSH, meta(7, big), cut, big[cut:])
        assert (done.status, done.received, done.checksum) == (200, len(big), xxhash.xxh3_64_hexdigest(big))
    shard = httpx.get(cluster.daemons[0].url + f"/v1/state/job/{ROLE}/7/shard", headers=AUTH)
    assert shard.content == big


def test_a_static_header_part_crosses_once_per_role_and_survives_a_restart(cluster: LocalCluster) -> None:
    """The header's static part (tensors, storages, layout) comes with a role's first push; later
    pushes name its digest and carry only the tree. A digest the receiver does not know is 428,
    and nothing is kept. The receiver's index and sidecars hold the part once."""
    start_ring(cluster, 1)
    static = {"tensors": [{"storage": 0, "dtype": "float32", "shape": [256, 256]}], "layout_roles": [ROLE], "unique_nbytes": len(DATA)}

    def meta_of(step: int) -> dict[str, Any]:
        got: dict[str, Any] = httpx.get(cluster.daemons[-1].url + f"/v1/state/job/{ROLE}/{step}", headers=AUTH).json()
        return got

    with connect(cluster, 0) as s:
        digest = static_digest(static)  # content-addressed: a part that does not hash to its name is refused
        wrong = _ask(s, Op.PUSH, meta(1, static="abc123", static_header=static), 0, DATA)
        assert wrong.status == 422 and "digest" in wrong.detail
        assert _ask(s, Op.PUSH, meta(1, static=digest, static_header=static), 0, DATA).status == 200
        assert _ask(s, Op.PUSH, meta(2, static=digest), 0, DATA).status == 200  # the digest alone
        unknown = _ask(s, Op.PUSH, meta(3, static="fff999"), 0, DATA)
        assert unknown.status == 428 and "send it" in unknown.detail
    assert _replicas(cluster, 0) == [(1, "replica"), (2, "replica")]
    assert meta_of(2)["header"] == {**static, "tree": 2} and meta_of(1)["header"] == {**static, "tree": 1}
    cluster.daemons[0].kill(signal.SIGKILL)  # reattached from the index: the part is found by its digest
    # a replica file the index no longer lists (a crash between the index transaction that replaced
    # it and its retirement) is reclaimed, not kept unaccounted in the tmpfs
    folder = cluster.roots[0] / "job" / "replica" / ROLE
    orphan = folder / "000000000000.bin"
    orphan.write_bytes(DATA)
    orphan.with_name(orphan.name + ".meta").write_text("{}")
    cluster.start_daemon("--gate-chunk-kb", "64", budget_mb=64, index=0)  # now daemons[-1]
    until(lambda: _replicas(cluster, len(cluster.daemons) - 1) == [(1, "replica"), (2, "replica")], what="the replicas reattached")
    assert meta_of(2)["header"] == {**static, "tree": 2}
    assert sorted(f.name for f in folder.glob("*.bin")) == ["000000000001.bin", "000000000002.bin"]
    assert not orphan.with_name(orphan.name + ".meta").exists()


@pytest.mark.parametrize(
    "token, frame, status",
    [
        (None, b"PUT /v1/replicas HTTP/1.1\r\nHost: n0\r\n\r\n", 400),  # not a bulk frame
        (None, BulkHead.hello("not-the-token"), 401),
        (None, BulkHead(Op.PUSH, len(meta(3)), 0, len(DATA)).pack() + meta(3) + DATA, 401),  # no HELLO first
        (None, BulkHead(Op.HELLO, 64 << 20, 0, 0).pack(), 400),  # a 64 MiB "token": refused from the head alone
        (TOKEN, BulkHead(Op.PUSH, 9, 0, 4).pack() + b'{"job":1}' + b"abcd", 422),
    ],
    ids=["http", "wrong-token", "push-before-hello", "huge-hello", "bad-metadata"],
)
def test_what_is_not_ours_is_answered_then_cut_off(cluster: LocalCluster, token: str | None, frame: bytes, status: int) -> None:
    start_ring(cluster, 1)
    assert httpx.get(cluster.daemons[0].url + "/v1/transfer").status_code == 401  # the port is told only to the job
    with connect(cluster, 0, token) as s:
        s.sendall(frame)
        head = _read(s, REPLY_HEAD_SIZE)
        code, n = BulkReply.body_len(head)
        reply = BulkReply.unpack(code, _read(s, n))
        assert reply.status == status and reply.detail
        s.settimeout(10)
        try:  # closed: nothing more of it is read (a reset, where unread bytes were left)
            assert s.recv(1) == b""
        except ConnectionResetError:
            pass
    assert _replicas(cluster, 0) == []
    assert daemon_state(cluster, 0)["transfer"]["bulk_refused"] == 1


@pytest.mark.parametrize("settled", [True, False], ids=["settled", "unsettled"])
def test_a_roles_replica_files_are_reused_and_hold_its_bytes(cluster: LocalCluster, settled: bool) -> None:
    """Every commit of node 0 goes to node 1 over the bulk port; once the role has its files,
    each push lands in the file of the version it retires (pages allocated and mapped already),
    bitwise. Settled saves keep two copies on each node (4x the shard in all), unsettled three."""
    _ring_of_two(cluster)
    # one role alone is settled by itself: the unsettled case is one of two roles, nobody settling
    layout = Layout() if settled else Layout(dp=2, dp_rank=0)
    ck = Checkpointer("job", layout, socket_path=cluster.socket(0), private_keys=("w",))
    try:
        for step in range(8):
            if settled:
                settle_all()  # as the DDP comm hook does before a step's all-reduce
            ck.save(step, {"w": torch.randn(512, 300, generator=torch.Generator().manual_seed(step))})
        ck.wait()
    finally:
        ck.close()
    until(lambda: daemon_state(cluster, 1)["transfer"]["bulk_pushes_received"] >= 8, what="eight pushes on the bulk port")
    got = daemon_state(cluster, 1)
    files = 2 if settled else 3
    assert got["transfer"]["reused_files"] >= 8 - files  # the first ones found no file to reuse
    primary = {v["step"]: v for v in daemon_state(cluster, 0)["roles"][0]["versions"]}
    assert sorted(primary) == list(range(8 - files, 8)) and sorted(r["step"] for r in got["replicas"]) == sorted(primary)
    for r in got["replicas"]:
        slot = (cluster.roots[0] / primary[r["step"]]["slot"]).read_bytes()[: r["nbytes"]]
        held = Path(cluster.roots[1] / "job" / "replica" / r["role"] / f"{r['step']:012d}.bin").read_bytes()
        assert held == slot and r["checksum"] == xxhash.xxh3_64_hexdigest(held)
    (role,) = daemon_state(cluster, 0)["roles"]
    shard = role["razored_bytes"]
    assert role["slots"] == files and role["memory"]["settled"] is settled
    assert role["memory"]["here_bytes"] == role["memory"]["successor_bytes"] == files * role["slot_bytes"]
    (replica,) = got["replica_memory"]
    assert replica["files"] == files and replica["bytes"] == files * shard  # measured there, not by the rule
    assert daemon_state(cluster, 0)["held"]["multiple"] == pytest.approx(files * role["slot_bytes"] / shard, abs=1e-3)
    assert role["memory"]["multiple"] == pytest.approx(2 * files * role["slot_bytes"] / shard, abs=1e-3)


def test_a_daemon_without_a_bulk_port_takes_pushes_over_http(cluster: LocalCluster) -> None:
    _ring_of_two(cluster, "--bulk-port", "-1")
    assert httpx.get(cluster.daemons[1].url + "/v1/transfer", headers=AUTH).json() == {"bulk_port": None}
    ck = Checkpointer("job", socket_path=cluster.socket(0))
    try:
        for step in range(3):
            ck.save(step, {"w": torch.full((1000,), float(step))})
        ck.wait()
    finally:
        ck.close()
    assert daemon_state(cluster, 0)["replication"]["pushes_in_one_request"] == 3
    assert daemon_state(cluster, 1)["transfer"]["bulk_port"] is None


def test_a_replica_whose_header_does_not_match_its_digest_is_refused(cluster: LocalCluster) -> None:
    """The header travels beside the bytes and is checked as they are: a replica whose tree does
    not hash to the digest its primary recorded is not kept (the sender's copy is the one to check)."""
    start_ring(cluster, 1)
    good = BulkMeta("job", ROLE, 5, len(DATA), xxhash.xxh3_64_hexdigest(DATA), {"tree_json": "[5]"}, "elsewhere", 5)
    with connect(cluster, 0) as s:
        bad = BulkMeta(**{**vars(good), "header_digest": header_digest({"tree_json": "[6]"})}).pack()
        refused = _ask(s, Op.PUSH, bad, 0, DATA)
        assert refused.status == 422 and "digest" in refused.detail
        ok = BulkMeta(**{**vars(good), "header_digest": header_digest({"tree_json": "[5]"})}).pack()
        assert _ask(s, Op.PUSH, ok, 0, DATA).status == 200
    assert _replicas(cluster, 0) == [(5, "replica")]
