"""The durable tier: committed shards copied to a directory every N steps, readable without ffplane.

Layout: ``<dir>/<job>/step-<step>/<role>.safetensors``. Each file is a standard safetensors file
with one ``U8`` tensor named ``shard`` (the shard's bytes: ``[private][replicated slice]``) and
``__metadata__`` holding ``ffplane_header`` (the JSON header: the state tree, every tensor's
storage/dtype/shape/stride/offset, every storage's stream and offset, the layout and this
shard's slice), ``checksum`` and ``algorithm`` (XXH3-64 of the shard bytes). To rebuild a state
without ffplane: concatenate the dp group's replicated slices in dp-rank order, append nothing
to the private part, and view each tensor at its storage's offset with its dtype and strides.
The files are the job's training state: created 0600, in folders created 0700 (a ``--durable-dir``
that exists already keeps its mode).
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path
from typing import Any

from ffplane_contract.checksum import ALGORITHM, checksum
from ffplane_contract.restorable import Layouts, whole_steps
from ffplane_contract.shard import header_digest, header_intact, layout_roles

log = logging.getLogger(__name__)


def step_dir(root: Path, job: str, step: int) -> Path:
    return root / job / f"step-{step:012d}"


def shard_path(root: Path, job: str, role: str, step: int) -> Path:
    return step_dir(root, job, step) / f"{role}.safetensors"


def encode_head(job: str, role: str, step: int, nbytes: int, digest: str, header: dict[str, Any]) -> bytes:
    """The bytes a shard file starts with: the safetensors length prefix and JSON head, padded
    to 8 bytes; the shard's bytes follow."""
    meta = {
        "ffplane_header": json.dumps(header),
        "header_digest": header_digest(header),  # the header is checked as the bytes are
        "checksum": digest,
        "algorithm": ALGORITHM,
        "step": str(step),
        "role": role,
        "job": job,
    }
    head = json.dumps({"__metadata__": meta, "shard": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}}).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head


def read_meta(path: Path) -> tuple[dict[str, str], int, int]:
    """(metadata, data offset, data length) of a shard file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        head = json.loads(f.read(n))
    begin, end = head["shard"]["data_offsets"]
    return head["__metadata__"], 8 + n + begin, end - begin


def verify(path: Path) -> bool:
    meta, offset, length = read_meta(path)
    with open(path, "rb") as f:
        f.seek(offset)
        if not header_intact(json.loads(meta["ffplane_header"]), meta.get("header_digest", "")):
            return False
        return checksum(f.read(length)) == meta["checksum"]


def shard(root: Path, job: str, role: str, step: int) -> dict[str, Any] | None:
    """``role``'s shard of ``step`` as a restore reads it (path, offset, nbytes, checksum,
    header), or None when there is none or it fails its checksum."""
    path = shard_path(root, job, role, step)
    try:
        if not verify(path):
            log.warning("corrupt durable shard", extra={"path": str(path)})
            return None
        meta, offset, length = read_meta(path)
    except (OSError, ValueError, KeyError, struct.error):
        return None
    return {
        "path": str(path),
        "offset": offset,
        "nbytes": length,
        "checksum": meta["checksum"],
        "header": json.loads(meta["ffplane_header"]),
    }


def layouts(root: Path, job: str) -> tuple[dict[str, set[int]], Layouts]:
    """The steps each role has a durable shard file for, and the layout each step's files name
    (read from their heads; checksums are ``shard``'s to verify)."""
    held: dict[str, set[int]] = {}
    found = Layouts()
    for path in (root / job).glob("step-*/*.safetensors"):
        step = int(path.parent.name.removeprefix("step-"))
        try:
            meta, _, _ = read_meta(path)
            found.add(step, layout_roles(json.loads(meta["ffplane_header"]), path.stem))
        except (OSError, ValueError, KeyError, struct.error):
            continue  # unreadable: not a copy
        held.setdefault(path.stem, set()).add(step)
    return held, found


def restorable(root: Path, job: str, below: int | None = None) -> tuple[int | None, dict[str, dict[str, Any]]]:
    """Newest durable step (< ``below``) holding an intact shard of every role of the layout that
    step was saved with; its shards by role."""
    held, found = layouts(root, job)
    for step in whole_steps(held, found, below):
        shards = {role: shard(root, job, role, step) for role in found.of(step)}
        if all(shards.values()):
            return step, {r: s for r, s in shards.items() if s is not None}
    return None, {}
