"""The header every state shard carries: JSON beside the bytes, written by the client's save,
kept by the daemon (slots, replicas, the durable tier) and read by restores and the coordinator.

The daemon reads only ``layout_roles`` (which roles make a whole step), ``unique_nbytes`` and
``lineage``; the rest is the client's to decode (``trainer_client.state_codec``).
"""

from __future__ import annotations

import json
from typing import Any, TypedDict

import xxhash

# A header's JSON, at most: it names every tensor of a shard. What a peer (the HTTP routes, the
# bulk port, once it has the token) may send of it, and what the daemon's index takes.
META_LIMIT = 64 << 20


class ShardHeader(TypedDict, total=False):
    tree: Any  # the state's structure, tensors as references (saves before tree_json)
    tree_json: str  # the same as JSON text: it crosses every daemon and hop unparsed, read by restores only
    tensors: list[dict[str, Any]]  # storage, dtype, shape, stride, storage_offset, requires_grad
    storages: list[dict[str, Any]]  # stream ("private" | "replicated"), offset, nbytes
    stream_nbytes: dict[str, int]
    role: str  # dp<r>-pp<r>-tp<r>
    layout: dict[str, int]
    layout_roles: list[str]  # every role of the job's layout: a step is whole when each has a shard
    private_nbytes: int  # the shard is [private part][this rank's slice of the replicated stream]
    piece: list[int]  # [lo, hi): the slice of the replicated stream
    unique_nbytes: int  # the state's bytes once (private + replicated)
    lineage: int  # the run segment; a restore never mixes two
    settled: bool  # the save was settled (its daemon says so): its successor keeps one replica fewer while the next arrives


# The keys that change from step to step (the tree holds loop counters, lr, a loader position);
# the rest is the header's static part, which a commit or a push sends only when it changes.
PER_STEP = ("tree", "tree_json", "settled")


def static_digest(static: dict[str, Any]) -> str:
    """The digest naming a header's static part: its content, so any holder can check it."""
    return xxhash.xxh3_64_hexdigest(json.dumps(static, sort_keys=True).encode())


def header_digest(header: dict[str, Any], static: str = "") -> str:
    """The digest of a whole header, which the daemon records beside the bytes' checksum at commit
    and every holder checks wherever it checks the bytes (a tree changed at rest is a corrupt copy,
    routed around as one). ``static``: the static part's digest where the caller holds it checked
    already; then the per-commit cost is hashing the tree's text as it is (not re-serialised:
    escaping a 150 KB tree cost 0.36 ms a commit)."""
    if not static:
        static = static_digest({k: v for k, v in header.items() if k not in PER_STEP})
    h = xxhash.xxh3_64(static.encode())
    for key in PER_STEP:
        if key in header:
            value = header[key]
            h.update(f"\n{key}\n".encode())
            h.update(value.encode() if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(",", ":")).encode())
    return h.hexdigest()


def header_intact(header: dict[str, Any], digest: str) -> bool:
    """Whether ``header`` is the one ``digest`` was taken of (static part recomputed). A copy
    recorded before headers had digests ("") has nothing to check against."""
    return not digest or header_digest(header) == digest


def layout_roles(header: dict[str, Any], role: str) -> list[str]:
    """The roles a whole step of this shard's job has (just ``role`` for a header that names none)."""
    return [str(r) for r in header.get("layout_roles", [role])]


def lineage(header: dict[str, Any]) -> int:
    return int(header.get("lineage", 0))


def check_header(value: object) -> ShardHeader:
    """``value`` as a shard header; ValueError naming the field that has the wrong type."""
    if not isinstance(value, dict):
        raise ValueError("a shard header is a JSON object")
    for key, kind in _TYPES.items():
        if key in value and not isinstance(value[key], kind):
            raise ValueError(f"shard header field {key!r} must be {kind.__name__}, got {type(value[key]).__name__}")
    if "layout_roles" in value and not all(isinstance(r, str) for r in value["layout_roles"]):
        raise ValueError("shard header field 'layout_roles' must list role names")
    return value  # type: ignore[return-value]


_TYPES: dict[str, type] = {
    "tree_json": str,
    "tensors": list,
    "storages": list,
    "stream_nbytes": dict,
    "role": str,
    "layout": dict,
    "layout_roles": list,
    "private_nbytes": int,
    "piece": list,
    "unique_nbytes": int,
    "lineage": int,
    "settled": bool,
}
