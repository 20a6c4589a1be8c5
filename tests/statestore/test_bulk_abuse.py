"""The bulk port looked at from outside: floods of idle, half-sent and garbage connections, huge
announcements before the token, a sender that stalls mid-push and a receiver whose tmpfs is full.
The daemon stays healthy and small, and a legitimate push and a restore go through meanwhile."""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import xxhash

from ffplane_harness.local_cluster import LocalCluster
from statestore.transport.bulk_server import AUTH_S, PREAUTH_CONNECTIONS, TAKEOVER_S
from statestore.transport.bulk_wire import META_LIMIT, BulkHead, BulkReply, Op
from tests._servers import TOKEN, until
from tests.statestore.conftest import daemon_state, small_tmpfs
from tests.statestore.test_bulk import AUTH, DATA, ROLE, _ring_of_two, bulk_port, connect, meta, read_reply
from trainer_client import Checkpointer


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(0.2)
    try:
        return sock.recv(65536) == b"" or _closed_by_peer(sock)  # a refusal's reply may come first
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


@pytest.fixture
def ring(cluster: LocalCluster) -> Iterator[LocalCluster]:
    _ring_of_two(cluster)
    yield cluster


def test_a_flood_before_the_token_costs_the_receiver_nothing_and_the_job_goes_on(ring: LocalCluster) -> None:
    """Idle connections (600: more than the pre-token cap), heads announcing 64 MiB of metadata,
    half-sent HELLOs and random bytes against node 1's bulk port, while node 0 commits steps that
    node 1 must take as replicas: the pushes and a restore go through, node 1's memory does not
    grow with what was announced, and the half-sent ones are closed within the HELLO deadline."""
    c = ring
    port = bulk_port(c, 1)
    pid = c.daemons[1].pid
    before = _rss_mib(pid)
    rng = random.Random(0)
    flood: list[socket.socket] = []
    try:
        for i in range(600):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            kind = i % 4
            if kind == 1:  # 64 MiB announced before the token: as a push, and as a HELLO
                op = Op.PUSH if i % 8 == 1 else Op.HELLO
                s.sendall(BulkHead(op, 0, 0, 0).pack()[:8] + (META_LIMIT).to_bytes(4, "little") + bytes(16))
            elif kind == 2:  # a HELLO head announcing a token, then a few bytes of it, then nothing
                s.sendall(BulkHead(Op.HELLO, 1000, 0, 0).pack() + b"abc")
            elif kind == 3:
                s.sendall(rng.randbytes(rng.randrange(1, 4096)))
            flood.append(s)
        ck = Checkpointer("job", socket_path=c.socket(0))
        try:
            for step in range(6):
                ck.save(step, {"w": torch.full((1 << 16,), float(step))})
            ck.wait()
            until(lambda: any(r["step"] == 5 and r["kind"] == "replica" for r in daemon_state(c, 1)["replicas"]), what="step 5's replica")
            reader = Checkpointer("job", socket_path=c.socket(0))
            restored = reader.restore()
            reader.close()
            assert restored is not None and restored.step == 5 and torch.equal(restored.state["w"], torch.full((1 << 16,), 5.0))
        finally:
            ck.close()
        state = daemon_state(c, 1)["transfer"]
        assert state["bulk_connections"]["unauthenticated"] <= PREAUTH_CONNECTIONS
        assert state["bulk_closed"]["evicted"] > 0 and state["bulk_refused"] >= 150  # idle ones made room; bad heads refused
        assert _rss_mib(pid) - before < 64, f"node 1's RSS grew from {before:.0f} to {_rss_mib(pid):.0f} MiB"
        assert httpx.get(c.daemons[1].url + "/v1/state").status_code == 200
        # every connection of the flood is gone within the HELLO deadline (refused, evicted or timed out)
        time.sleep(AUTH_S + 1)
        still_open = [s for s in flood if not _closed_by_peer(s)]
        assert not still_open, f"{len(still_open)} flood connections still open after {AUTH_S + 1} s"
    finally:
        for s in flood:
            s.close()


def test_a_stalled_sender_neither_blocks_nor_loses_what_it_sent(ring: LocalCluster) -> None:
    """A sender that stops mid-push holds the transfer only while it makes progress: a second
    sender of the same shard is told at once to come back, then takes it over and resumes from
    what the first one landed; the stalled connection is closed."""
    c = ring
    first = connect(c, 1)
    second = connect(c, 1)
    try:
        first.sendall(BulkHead(Op.PUSH, len(meta(40)), 0, len(DATA)).pack() + meta(40) + DATA[:100_000])
        until(lambda: any(r.get("received") == 100_000 for r in daemon_state(c, 1)["replicas"]), what="the first sender's bytes")
        second.settimeout(TAKEOVER_S / 2)  # the answer comes at once, not when the first sender gives up
        assert _push(second, 40, 0, DATA).received == 100_000  # told where to resume
        busy = _push(second, 40, 100_000, DATA[100_000:])
        assert busy.status == 409 and "under way" in busy.detail
        second.settimeout(30)
        time.sleep(TAKEOVER_S + 0.5)
        done = _push(second, 40, 100_000, DATA[100_000:])  # the first one stalled: taken over
        assert (done.status, done.received, done.checksum) == (200, len(DATA), xxhash.xxh3_64_hexdigest(DATA))
        assert until(lambda: _closed_by_peer(first), what="the stalled connection closed")
        assert daemon_state(c, 1)["transfer"]["bulk_closed"]["taken_over"] == 1
    finally:
        first.close()
        second.close()
    shard = httpx.get(c.daemons[1].url + f"/v1/state/job/{ROLE}/40/shard", headers=AUTH)
    assert shard.content == DATA


def _push(sock: socket.socket, step: int, offset: int, body: bytes) -> BulkReply:
    raw = meta(step)
    sock.sendall(BulkHead(Op.PUSH, len(raw), offset, len(body)).pack() + raw + body)
    return read_reply(sock)


@pytest.fixture
def small_tmpfs_node1(cluster: LocalCluster) -> Iterator[Path]:
    """Node 1's root on a 48 MiB tmpfs of its own."""
    with small_tmpfs(cluster, 1) as where:
        yield where


def test_a_receiver_with_a_full_tmpfs_says_so_at_once_and_keeps_the_connection(cluster: LocalCluster, small_tmpfs_node1: Path) -> None:
    """Node 1's budget fits its tmpfs, but something else fills the tmpfs: a push is refused with
    a ``CapacityError`` naming the tmpfs (not a reset), nothing of it is left, the connection takes
    the next request, and node 0's commit is answered without waiting out the replica bound."""
    cluster.start_daemon("--gate-chunk-kb", "64", budget_mb=64)
    cluster.start_daemon("--gate-chunk-kb", "64", budget_mb=32)  # within its tmpfs: the daemon checks at start
    until(lambda: daemon_state(cluster, 0)["coordinator"].get("successor") == "n1", what="node 0 to know its successor")
    filler = small_tmpfs_node1 / "filler"
    with open(filler, "wb") as f:
        try:
            f.write(bytes(47 << 20))
        except OSError:
            pass
    big = os.urandom(4 << 20)
    with connect(cluster, 1) as s:
        raw = meta(1, big)
        s.sendall(BulkHead(Op.PUSH, len(raw), 0, len(big)).pack() + raw + big)
        reply = read_reply(s)
        assert reply.status == 413 and "tmpfs" in reply.detail and "no room" in reply.detail
        assert not list(small_tmpfs_node1.glob("job/replica/*/*.part"))
        s.sendall(BulkHead.hello(TOKEN))  # the connection reads on: answered, not reset
        assert read_reply(s).status == 200
    ck = Checkpointer("job", socket_path=cluster.socket(0))
    try:
        ck.save(0, {"w": torch.from_numpy(np.frombuffer(big, dtype=np.uint8).copy())})
        ck.save(1, {"w": torch.zeros(4 << 20, dtype=torch.uint8)})
        ck.wait()
    finally:
        ck.close()
    rep = until(lambda: (r := daemon_state(cluster, 0)["replication"])["refused_for_room"] >= 1 and r, what="the refusal counted")
    assert "no room" in (rep["last_error"] or "")
    # the waiting commit was answered on the refusal, not after the replica bound ran out
    assert "the successor has no room for the replica; answering the commit without it" in cluster.daemons[0].log()
    metrics = httpx.get(cluster.daemons[0].url + "/metrics").text
    assert "ffplane_replication_refused_for_room" in metrics
