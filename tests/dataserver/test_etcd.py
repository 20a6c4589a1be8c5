"""The etcd v3 client against a real 3-member cluster: compare-and-set, prefixes, leases, and
failing over when the member it talks to is killed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ffplane_harness.etcd_cluster import EtcdCluster
from ffplane_runtime.etcd import Etcd, EtcdUnavailable, parse_endpoints
from tests._servers import TOKEN


def test_compare_and_set_writes_only_over_the_revision_it_read(etcd: EtcdCluster) -> None:
    e = etcd.client()
    rev, _ = e.cas(b"/t/k", b"one", 0)
    assert rev is not None
    again, current = e.cas(b"/t/k", b"two", 0)  # "must not exist" fails: it exists
    assert again is None and current is not None and current.value == b"one" and current.mod_revision == rev
    stale, _ = e.cas(b"/t/k", b"two", rev - 1)
    assert stale is None
    rev2, _ = e.cas(b"/t/k", b"two", rev)
    assert rev2 is not None and rev2 > rev
    kv = e.get(b"/t/k")
    assert kv is not None and (kv.value, kv.mod_revision) == (b"two", rev2)
    e.put(b"/t/l", b"x")
    e.put(b"/u", b"y")
    assert [kv.key for kv in e.get_prefix(b"/t/")] == [b"/t/k", b"/t/l"]
    assert e.delete_prefix(b"/t/") == 2 and e.get(b"/t/k") is None and e.get(b"/u") is not None


def test_a_lease_takes_its_keys_with_it(etcd: EtcdCluster) -> None:
    e = etcd.client()
    lease, ttl = e.grant(1)
    assert ttl >= 1
    e.put(b"/lease/k", b"v", lease=lease)
    assert e.keepalive(lease) >= 1
    deadline = time.monotonic() + 15
    while e.get(b"/lease/k") is not None:  # no more keep-alives: it expires
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.1)
    assert e.keepalive(lease) == 0
    lease2, _ = e.grant(30)
    e.put(b"/lease/k2", b"v", lease=lease2)
    e.revoke(lease2)
    assert e.get(b"/lease/k2") is None


def test_the_client_moves_to_the_next_member_when_its_member_dies(etcd: EtcdCluster) -> None:
    e = etcd.client()
    e.put(b"/k", b"before")
    etcd.members[0].kill()  # the first endpoint listed: the one it talks to
    assert e.put(b"/k", b"after") > 0
    kv = e.get(b"/k")
    assert kv is not None and kv.value == b"after"
    etcd.members[1].kill()  # quorum lost: a clear error, in the retry time
    short = Etcd(etcd.endpoints, timeout_s=0.3, retry_s=1.5)
    with pytest.raises(EtcdUnavailable, match="majority of the members"):
        short.put(b"/k", b"lost")


def test_endpoints_are_parsed_or_refused_with_the_expected_form() -> None:
    assert parse_endpoints("10.0.0.1:2379, http://h:2380/") == ["http://10.0.0.1:2379", "http://h:2380"]
    for bad in ("", "host", "host:port", ","):
        with pytest.raises(ValueError, match="host:port"):
            parse_endpoints(bad)


def test_a_data_server_whose_etcd_does_not_answer_at_start_refuses_in_one_line(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{s.getsockname()[1]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FFPLANE_")} | {"FFPLANE_TOKEN": TOKEN}
    argv = ["serve", "--data-dir", str(tmp_path), "--port", "0", "--etcd", nowhere, "--etcd-wait-s", "1", "--log-format", "text"]
    r = subprocess.run([sys.executable, "-m", "dataserver", *argv], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("dataserver serve: error: --etcd") and f"http://{nowhere}" in line and "within 1s" in line, line
