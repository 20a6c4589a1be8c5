"""A small client of etcd v3's JSON gateway: the engine that holds what must outlive any one host
(torchrun's rendezvous, which data server coordinates, which nodes the coordinator declared dead).

etcd answers plain HTTP+JSON on its client port (``/v3/kv/range``, ``/v3/kv/txn``,
``/v3/lease/grant`` ...; keys and values base64, 64-bit integers as strings), so no gRPC stack or
third-party client is needed. A client holds every member's endpoint and moves to the next when
one does not answer or has no leader, so it fails only when the cluster has lost its quorum
(decisions.md, "No single point of failure: etcd holds what outlives a host").

Blocking on purpose: torchrun's rendezvous handler calls it from the agent's threads; the data
server calls it from a thread of its own.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ffplane_contract.errors import UnavailableError

# The nodes the coordinator declared dead: one key each, ``DEAD_PREFIX + node id``, put when it is
# declared and deleted when it is back in the ring; its ``mod_revision`` orders it against joins.
DEAD_PREFIX = b"/ffplane/nodes/dead/"
# The coordinator's alive members (JSON node → address), for the one that takes over from it.
ALIVE_KEY = b"/ffplane/nodes/alive"


class EtcdUnavailable(UnavailableError):
    """No etcd member answered with a leader in time: the cluster lost its quorum or none of the
    endpoints given is a member. Check ``etcdctl endpoint health --cluster``."""


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    mod_revision: int  # the cluster revision of its last write: the compare-and-set token
    create_revision: int
    lease: int = 0


def parse_endpoints(spec: str | Sequence[str]) -> list[str]:
    """``"h1:2379,http://h2:2379"`` (or a list) as base URLs; ValueError naming a bad one."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        url = item if "://" in item else f"http://{item}"
        host = url.split("://", 1)[1].rstrip("/")
        if not host or ":" not in host or not host.rsplit(":", 1)[1].isdigit():
            raise ValueError(f"etcd endpoint {item!r} is not host:port (e.g. 10.0.0.1:2379)")
        out.append(url.rstrip("/"))
    if not out:
        raise ValueError("no etcd endpoint given: pass host:port[,host:port...] of the etcd members")
    return out


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key starting with ``prefix`` (etcd's range_end for a prefix)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


def _kv(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(
        base64.b64decode(raw["key"]),
        base64.b64decode(raw.get("value", "")),
        int(raw.get("mod_revision", 0)),
        int(raw.get("create_revision", 0)),
        int(raw.get("lease", 0)),
    )


# answers that mean "ask again, maybe elsewhere": no leader yet, a leader change under the request
_RETRY_MESSAGES = ("no leader", "leader changed", "timed out", "too many requests", "not capable", "stopped")


class Etcd:
    """Blocking etcd v3 client over the JSON gateway, failing over between ``endpoints``.

    Each call retries (next endpoint, short backoff) for up to ``retry_s`` before raising
    :class:`EtcdUnavailable`; ``timeout_s`` bounds one HTTP request.
    """

    def __init__(self, endpoints: str | Sequence[str], timeout_s: float = 1.0, retry_s: float = 10.0) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.timeout_s, self.retry_s = timeout_s, retry_s
        self._at = 0  # the endpoint that answered last
        self._lock = threading.Lock()

    # --- transport ---------------------------------------------------------------------------
    def _call(self, path: str, body: dict[str, Any], retry_s: float | None = None) -> dict[str, Any]:
        wait_s = self.retry_s if retry_s is None else retry_s
        deadline = time.monotonic() + wait_s
        data = json.dumps(body).encode()
        last = "no attempt"
        delay = 0.02
        while True:
            for _ in range(len(self.endpoints)):
                with self._lock:
                    at = self._at
                url = self.endpoints[at] + path
                try:
                    req = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method="POST")
                    with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                        answer: dict[str, Any] = json.loads(r.read())
                        return answer
                except urllib.error.HTTPError as exc:
                    text = exc.read().decode(errors="replace")
                    if exc.code < 500 and not any(m in text for m in _RETRY_MESSAGES):
                        raise ValueError(f"etcd refused {path}: HTTP {exc.code} {text}") from exc
                    last = f"{url}: HTTP {exc.code} {text.strip()[:200]}"
                except (OSError, ValueError) as exc:  # refused, reset, timed out, a torn answer
                    last = f"{url}: {exc}"
                with self._lock:
                    if self._at == at:
                        self._at = (at + 1) % len(self.endpoints)
            if time.monotonic() + delay > deadline:
                raise EtcdUnavailable(
                    f"no etcd member of {','.join(self.endpoints)} answered {path} within {wait_s:g}s "
                    f"(last: {last}); check that a majority of the members run (etcdctl endpoint health --cluster)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    # --- keys ----------------------------------------------------------------------------------
    def get(self, key: bytes, retry_s: float | None = None) -> KeyValue | None:
        kvs = self._call("/v3/kv/range", {"key": _b64(key)}, retry_s).get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: bytes, retry_s: float | None = None) -> list[KeyValue]:
        """Every key starting with ``prefix``, in key order."""
        body = {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))}
        return [_kv(kv) for kv in self._call("/v3/kv/range", body, retry_s).get("kvs", [])]

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Write ``key``; returns its new ``mod_revision``."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self._call("/v3/kv/put", body)["header"]["revision"])

    def delete(self, key: bytes) -> bool:
        """Remove ``key``; whether it existed."""
        return int(self._call("/v3/kv/deleterange", {"key": _b64(key)}).get("deleted", 0)) > 0

    def delete_prefix(self, prefix: bytes) -> int:
        body = {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))}
        return int(self._call("/v3/kv/deleterange", body).get("deleted", 0))

    def cas(self, key: bytes, value: bytes, mod_revision: int, lease: int = 0) -> tuple[int | None, KeyValue | None]:
        """Write ``key`` only if its ``mod_revision`` is still ``mod_revision`` (0: only if it
        does not exist). Returns (the new revision, None) when written, else (None, what is there
        now, or None if nothing is)."""
        rev, current = self.txn({key: mod_revision}, {key: value}, lease)
        return rev, None if rev is not None else current[key]

    def txn(self, expect: dict[bytes, int], puts: dict[bytes, bytes], lease: int = 0) -> tuple[int | None, dict[bytes, KeyValue | None]]:
        """Write every key of ``puts`` (none: only check) in one transaction, only if every key of
        ``expect`` still has that ``mod_revision`` (0: does not exist). Returns (the new revision,
        {}) when it went through, else (None, what each expected key holds now)."""
        keys = list(expect)
        put_ops = []
        for key, value in puts.items():
            op: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
            if lease:
                op["lease"] = str(lease)
            put_ops.append({"request_put": op})
        body = {
            "compare": [{"key": _b64(k), "target": "MOD", "result": "EQUAL", "mod_revision": str(expect[k])} for k in keys],
            "success": put_ops,
            "failure": [{"request_range": {"key": _b64(k)}} for k in keys],
        }
        answer = self._call("/v3/kv/txn", body)
        if answer.get("succeeded"):
            return int(answer["header"]["revision"]), {}
        now: dict[bytes, KeyValue | None] = {}
        for key, response in zip(keys, answer.get("responses", [])):
            kvs = response["response_range"].get("kvs", [])
            now[key] = _kv(kvs[0]) if kvs else None
        return None, now

    # --- leases --------------------------------------------------------------------------------
    def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease; (its id, the TTL etcd granted — at least its minimum, ~2 s)."""
        answer = self._call("/v3/lease/grant", {"TTL": str(ttl_s)})
        if answer.get("error"):
            raise EtcdUnavailable(f"etcd refused a lease: {answer['error']}")
        return int(answer["ID"]), int(answer["TTL"])

    def keepalive(self, lease: int, retry_s: float | None = None) -> int:
        """Renew ``lease``; the TTL left, 0 if it has expired (its keys are gone)."""
        answer = self._call("/v3/lease/keepalive", {"ID": str(lease)}, retry_s)
        return int(answer.get("result", {}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        """End ``lease`` now, deleting its keys (a clean hand-over)."""
        try:
            self._call("/v3/lease/revoke", {"ID": str(lease)}, retry_s=2.0)
        except ValueError:  # already expired: nothing to end
            pass
