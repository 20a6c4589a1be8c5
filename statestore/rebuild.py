"""Rebuilding a lost or damaged index from the files it described.

A daemon whose ``_index`` is garbled (LMDB refuses it) or deleted would otherwise stop, or forget
every slot and replica it holds and leave them orphaned in the tmpfs. Every committed version and
replica has a sidecar (``<file>.meta``, see ``index.py``); a rebuild adopts each one whose bytes
still match its checksum, and moves what it cannot verify to ``<root>/_quarantine/`` for a person
to look at. Cached batches are not rebuilt: the data server sends them again.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ffplane_contract.checksum import checksum
from statestore import shm
from statestore.index import SIDECAR, Index, read_sidecar
from statestore.replicas import SPARE, STATICS_KEY
from statestore.retention import MIN_VERSIONS
from statestore.slots import version_key

log = logging.getLogger(__name__)
QUARANTINE = "_quarantine"
_SLOT = re.compile(r"^slot-(\d+)-(\d+)\.bin$")


@dataclass
class Rebuilt:
    versions: int = 0
    replicas: int = 0
    quarantined: list[str] = field(default_factory=list)  # paths relative to the root, as they were


def _intact(path: Path, nbytes: int, digest: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_size < nbytes:
            return False
        if nbytes == 0:
            return checksum(b"") == digest
        with mmap.mmap(fd, nbytes, prot=mmap.PROT_READ) as mm:
            return checksum(memoryview(mm)) == digest
    finally:
        os.close(fd)


def set_aside(root: Path, path: Path, stamp: str) -> str:
    """Move ``path`` (a file or the index folder) under ``<root>/_quarantine/<stamp>/``."""
    rel = path.relative_to(root)
    dest = root / QUARANTINE / stamp / rel
    shm.private_dir(dest.parent)
    os.replace(path, dest)
    return str(rel)


def rebuild(root: Path, index: Index, stamp: str | None = None) -> Rebuilt:
    """Fill a fresh ``index`` from the slot and replica files under ``root``."""
    stamp = stamp or time.strftime("%Y%m%dT%H%M%S")
    out = Rebuilt()
    for role_dir in sorted(root.glob("*/state/*")):
        _role(root, index, role_dir, out, stamp)
    statics: dict[Path, dict[str, dict[str, Any]]] = {}  # a replica role folder → its static header parts
    for path in sorted(root.glob("*/replica/*/*.bin")):
        if path.name == SPARE:  # a retired file kept for the next push: nothing in it counts
            path.unlink(missing_ok=True)
            continue
        meta = read_sidecar(path)
        rel = str(path.relative_to(root))
        known = statics.setdefault(path.parent, _statics(path.parent))
        static = meta.get("static", "") if meta is not None else ""
        if (
            meta is not None
            and meta.get("path") == rel
            and (not static or static in known)
            and _intact(path, int(meta.get("nbytes", -1)), str(meta.get("checksum")))
        ):
            index.put(f"replica/{meta['job']}/{meta['role']}/{int(meta['step']):012d}", meta)
            if static:
                index.put(f"{STATICS_KEY}{meta['job']}/{meta['role']}/{static}", known[static])
            out.replicas += 1
            continue
        out.quarantined.append(set_aside(root, path, stamp))
        if path.with_name(path.name + SIDECAR).exists():
            set_aside(root, path.with_name(path.name + SIDECAR), stamp)
    return out


def _statics(role_dir: Path) -> dict[str, dict[str, Any]]:
    """The static header parts recorded in a role's folder (``static-<digest>`` sidecars)."""
    found = {}
    for path in role_dir.glob(f"static-*{SIDECAR}"):
        digest = path.name.removeprefix("static-").removesuffix(SIDECAR)
        value = read_sidecar(path.with_name(path.name.removesuffix(SIDECAR)))
        if value is not None:
            found[digest] = value
    return found


def _role(root: Path, index: Index, role_dir: Path, out: Rebuilt, stamp: str) -> None:
    job, role = role_dir.parts[-3], role_dir.name
    gens: dict[int, list[Path]] = {}
    for path in role_dir.iterdir():
        m = _SLOT.match(path.name)
        if m:
            gens.setdefault(int(m.group(1)), []).append(path)
    # the role's slot set: the newest generation that is whole (at least the fewest slots a role has, one size)
    current = next(
        (g for g in sorted(gens, reverse=True) if len(gens[g]) >= MIN_VERSIONS and len({p.stat().st_size for p in gens[g]}) == 1), None
    )
    if current is None:
        for paths in gens.values():
            out.quarantined += [set_aside(root, p, stamp) for p in paths]
        return
    paths = sorted(gens[current])
    index.put(f"slots/{job}/{role}", {"gen": current, "size": paths[0].stat().st_size, "paths": [str(p.relative_to(root)) for p in paths]})
    statics = _statics(role_dir)
    found: dict[int, dict[str, Any]] = {}
    for gen_paths in gens.values():
        for path in gen_paths:
            meta = read_sidecar(path)
            if meta is None or meta.get("path") != str(path.relative_to(root)) or (meta.get("static") and meta["static"] not in statics):
                continue  # a slot that holds no committed version (free, or overwritten since)
            if not _intact(path, int(meta.get("nbytes", -1)), str(meta.get("checksum"))):
                log.warning("slot fails its checksum: not adopted", extra={"path": str(path)})
                continue
            step = int(meta["step"])
            if step not in found or meta.get("committed_at", 0) > found[step].get("committed_at", 0):
                found[step] = meta
    kept = sorted(found, reverse=True)[: len(paths)]
    for step in kept:
        index.put(version_key(job, role, step), found[step])
        out.versions += 1
    referenced = {root / found[s]["path"] for s in kept} | set(paths)
    for gen_paths in gens.values():  # an older generation's slots that hold nothing kept
        for path in set(gen_paths) - referenced:
            path.unlink(missing_ok=True)
            path.with_name(path.name + SIDECAR).unlink(missing_ok=True)
    for digest, value in statics.items():
        index.put(f"statics/{job}/{role}/{digest}", value)
