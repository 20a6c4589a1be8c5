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
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from statestore.checksum import ALGORITHM, checksum
from statestore.shm import open_private, private_dir

log = logging.getLogger(__name__)


def step_dir(root: Path, job: str, step: int) -> Path:
    return root / job / f"step-{step:012d}"


def write_shard(
    root: Path, job: str, role: str, step: int, data: memoryview, digest: str, header: dict[str, Any],
    admit: Callable[[int], None] | None = None, chunk: int = 4 << 20,
) -> Path:
    """Write one shard file (temp file, fsync, rename). ``admit(n)`` is called before each chunk
    of ``n`` bytes: the daemon's link gate, when the durable directory is a network file system."""
    directory = private_dir(step_dir(root, job, step))  # 0700 from --durable-dir down, where created
    meta = {"ffplane_header": json.dumps(header), "checksum": digest, "algorithm": ALGORITHM, "step": str(step), "role": role, "job": job}
    head = json.dumps({"__metadata__": meta, "shard": {"dtype": "U8", "shape": [len(data)], "data_offsets": [0, len(data)]}}).encode()
    head += b" " * (-len(head) % 8)
    final = directory / f"{role}.safetensors"
    tmp = final.with_name(final.name + f".tmp-{os.getpid()}")
    with open(tmp, "wb", opener=open_private) as f:  # 0600
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for at in range(0, len(data), chunk):
            if admit is not None:
                admit(min(chunk, len(data) - at))
            f.write(data[at : at + chunk])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return final


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
        return checksum(f.read(length)) == meta["checksum"]


def shard(root: Path, job: str, role: str, step: int) -> dict[str, Any] | None:
    """``role``'s shard of ``step`` as a restore reads it (path, offset, nbytes, checksum,
    header), or None when there is none or it fails its checksum."""
    path = step_dir(root, job, step) / f"{role}.safetensors"
    try:
        if not verify(path):
            log.warning("corrupt durable shard", extra={"path": str(path)})
            return None
        meta, offset, length = read_meta(path)
    except (OSError, ValueError, KeyError, struct.error):
        return None
    return {"path": str(path), "offset": offset, "nbytes": length, "checksum": meta["checksum"], "header": json.loads(meta["ffplane_header"])}


def steps_by_role(root: Path, job: str, roles: set[str]) -> dict[str, set[int]]:
    """The steps each role has a durable shard file for (not verified: ``shard`` does that)."""
    out: dict[str, set[int]] = {}
    for path in (root / job).glob("step-*/*.safetensors"):
        if path.stem in roles:
            out.setdefault(path.stem, set()).add(int(path.parent.name.removeprefix("step-")))
    return out


def restorable(root: Path, job: str, roles: set[str], below: int | None = None) -> tuple[int | None, dict[str, dict[str, Any]]]:
    """Newest durable step (< ``below``) holding an intact shard of every role in ``roles`` (or of
    its layout)."""
    base = root / job
    if not base.is_dir():
        return None, {}
    for directory in sorted(base.glob("step-*"), reverse=True):
        step = int(directory.name.removeprefix("step-"))
        if below is not None and step >= below:
            continue
        files = {p.stem: p for p in directory.glob("*.safetensors")}
        if not files:
            continue
        first_meta, _, _ = read_meta(next(iter(files.values())))
        expected = set(roles) | set(json.loads(first_meta["ffplane_header"]).get("layout_roles", []))
        if not expected <= set(files):
            continue
        shards = {role: shard(root, job, role, step) for role in expected}
        if all(shards.values()):
            return step, {r: s for r, s in shards.items() if s is not None}
    return None, {}
