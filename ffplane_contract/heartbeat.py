"""The UDP heartbeat datagrams between a node daemon and the coordinator.

A beat: ``header | node id (utf-8) | payload | MAC``; the payload of an ``INV`` beat is
``zlib(JSON [inventory, workers])``. An answer: ``header | events | MAC``, the events being the
JSON list of membership changes the daemon missed (view ``EVENTS``). MAC = HMAC-SHA256(job
token, everything before it)[:16]. Integers are big-endian. A datagram that is short, long, of
the wrong magic or fails its MAC decodes to None: the receiver drops it without answering.
"""

from __future__ import annotations

import hmac
import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any

BEAT_MAGIC = b"FFB1"
ANSWER_MAGIC = b"FFA1"
BEAT_HEADER = struct.Struct("!4sBB8sQQQQ")  # magic, kind, len(node id), session, counter, inventory version, view epoch, view version
ANSWER_HEADER = struct.Struct("!4sBBQQQ")  # magic, status, view, counter (echoed), view epoch, view version
MAC_BYTES = 16
MAX_DATAGRAM = 8192  # bigger inventories go over HTTP
MAX_INVENTORY_BYTES = 16 << 20  # decompressed

KIND_BEAT, KIND_INV = 0, 1  # INV: the payload carries the inventory
STATUS_OK, STATUS_UNKNOWN, STATUS_STALE = 0, 1, 2  # UNKNOWN: send a full HTTP heartbeat; STALE: resend the inventory
VIEW_CURRENT, VIEW_EVENTS, VIEW_FULL = 0, 1, 2  # FULL: fetch GET /v1/nodes/view


def mac(key: bytes, data: bytes) -> bytes:
    return hmac.digest(key, data, "sha256")[:MAC_BYTES]


def _authentic(key: bytes, data: bytes, magic: bytes, header: struct.Struct) -> bytes | None:
    if len(data) < header.size + MAC_BYTES or len(data) > MAX_DATAGRAM or data[:4] != magic:
        return None
    body = data[:-MAC_BYTES]
    return body if hmac.compare_digest(mac(key, body), data[-MAC_BYTES:]) else None


@dataclass(frozen=True)
class Beat:
    """A daemon's liveness beat; ``payload`` is an encoded inventory when ``kind`` is INV."""

    kind: int
    node_id: str
    session: bytes  # 8 bytes: the daemon process's heartbeat session
    counter: int  # strictly increasing per session: replays are dropped
    inv_version: int
    epoch: int  # of the ring view the daemon holds
    view_version: int
    payload: bytes = b""

    def encode(self, key: bytes) -> bytes:
        nid = self.node_id.encode()
        body = BEAT_HEADER.pack(
            BEAT_MAGIC, self.kind, len(nid), self.session, self.counter, self.inv_version, self.epoch, self.view_version
        )
        return body + nid + self.payload + mac(key, body + nid + self.payload)

    @classmethod
    def decode(cls, key: bytes, data: bytes) -> Beat | None:
        body = _authentic(key, data, BEAT_MAGIC, BEAT_HEADER)
        if body is None:
            return None
        _, kind, idlen, session, counter, inv_version, epoch, view_version = BEAT_HEADER.unpack_from(body)
        end = BEAT_HEADER.size + idlen
        try:
            node_id = body[BEAT_HEADER.size : end].decode()
        except UnicodeDecodeError:
            return None
        return cls(kind, node_id, session, counter, inv_version, epoch, view_version, body[end:])

    @staticmethod
    def room(node_id: str, payload: bytes) -> bool:
        """Whether a beat with this payload fits one datagram (else it goes over HTTP)."""
        return BEAT_HEADER.size + len(node_id.encode()) + len(payload) + MAC_BYTES <= MAX_DATAGRAM


@dataclass(frozen=True)
class Answer:
    """The coordinator's answer to an authentic beat; ``events`` is encoded (``encode_events``)."""

    status: int
    view: int
    counter: int  # the beat's, echoed
    epoch: int
    version: int
    events: bytes = b""

    def encode(self, key: bytes) -> bytes:
        body = ANSWER_HEADER.pack(ANSWER_MAGIC, self.status, self.view, self.counter, self.epoch, self.version) + self.events
        return body + mac(key, body)

    @classmethod
    def decode(cls, key: bytes, data: bytes) -> Answer | None:
        body = _authentic(key, data, ANSWER_MAGIC, ANSWER_HEADER)
        if body is None:
            return None
        _, status, view, counter, epoch, version = ANSWER_HEADER.unpack_from(body)
        return cls(status, view, counter, epoch, version, body[ANSWER_HEADER.size :])


# A membership event: ["+", node id, address] (joined or back) or ["-", node id] (dead).
Event = list[str]


def encode_events(events: list[Event]) -> bytes:
    return json.dumps(events, separators=(",", ":")).encode()


def decode_events(raw: bytes) -> list[Event]:
    """The events of an answer; raises ValueError if they are not a list of events."""
    events = json.loads(raw)
    if not isinstance(events, list) or not all(isinstance(e, list) and len(e) >= 2 and e[0] in ("+", "-") for e in events):
        raise ValueError("membership events of the wrong shape")
    return [[str(x) for x in e] for e in events]


def encode_inventory(inventory: dict[str, Any], workers: list[dict[str, Any]]) -> bytes:
    return zlib.compress(json.dumps([inventory, workers], separators=(",", ":"), sort_keys=True).encode(), 1)


def decode_inventory(raw: bytes) -> tuple[dict[str, dict[str, list[dict[str, Any]]]], list[dict[str, Any]]]:
    """(inventory, workers) of an INV payload; raises ValueError if too large or misshapen."""
    d = zlib.decompressobj()
    text = d.decompress(raw, MAX_INVENTORY_BYTES)
    if d.unconsumed_tail or not d.eof:
        raise ValueError("inventory too large or truncated")
    inventory, workers = json.loads(text)
    if not (
        isinstance(inventory, dict)
        and all(
            isinstance(roles, dict) and all(isinstance(vs, list) and all(isinstance(v, dict) for v in vs) for vs in roles.values())
            for roles in inventory.values()
        )
        and isinstance(workers, list)
        and all(isinstance(w, dict) for w in workers)
    ):
        raise ValueError("inventory or workers of the wrong shape")
    return inventory, workers
