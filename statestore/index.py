"""The daemon's LMDB index: what is where in shared memory, so a restart can reattach.

One environment per root (``<root>/_index``), keys ``<kind>/<job>/...`` and JSON values. It sits
on the same tmpfs as the data it describes: both survive a daemon crash, both go with a reboot.

The index is not the only record: every committed slot version and replica also has a *sidecar*
beside its file (``<file>.meta``, the same JSON the index holds), and every static header part a
``static-<digest>.json``. A damaged or deleted index is rebuilt from them (``rebuild.py``); the
index stays the fast path, the sidecars are what makes losing it survivable.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lmdb

from statestore.shm import tmp_path, unlink

SIDECAR = ".meta"


class Index:
    def __init__(self, root: Path, map_size: int = 1 << 30) -> None:
        path = root / "_index"
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path = path
        # sync=False: a process crash keeps every committed transaction (it is in the page
        # cache); only a machine crash could lose some, and that loses the tmpfs data anyway.
        self._env = lmdb.open(str(path), map_size=map_size, sync=False, metasync=False, max_dbs=0, mode=0o600)

    @classmethod
    def open_checked(cls, root: Path) -> tuple[Index | None, str]:
        """The index, or None with why it cannot be used: ``"missing"`` (no data file although
        the root holds state) or ``"damaged: ..."`` (LMDB refuses it or a record does not parse)."""
        data = root / "_index" / "data.mdb"
        if not data.exists():
            return (None, "missing") if holds_state(root) else (cls(root), "")
        try:
            index = cls(root)
        except lmdb.Error as exc:
            return None, f"damaged: {exc}"
        try:
            with index._env.begin() as txn:
                for _, value in txn.cursor():
                    json.loads(value)
        except (lmdb.Error, ValueError) as exc:
            index.close()
            return None, f"damaged: {exc}"
        return index, ""

    def put(self, key: str, value: dict[str, Any] | bytes, replacing: Iterable[str] = ()) -> None:
        """Store ``value`` (or its JSON, ``encode``d once for the sidecar too) at ``key`` and
        delete the keys it replaces, in one transaction."""
        with self._env.begin(write=True) as txn:
            txn.put(key.encode(), value if isinstance(value, bytes) else encode(value))
            for old in replacing:
                txn.delete(old.encode())

    def get(self, key: str) -> dict[str, Any] | None:
        with self._env.begin() as txn:
            raw = txn.get(key.encode())
        return None if raw is None else json.loads(raw)

    def delete(self, *keys: str) -> None:
        with self._env.begin(write=True) as txn:
            for key in keys:
                txn.delete(key.encode())

    def items(self, prefix: str) -> list[tuple[str, dict[str, Any]]]:
        p = prefix.encode()
        out = []
        with self._env.begin() as txn:
            cur = txn.cursor()
            if cur.set_range(p):
                for k, v in cur:
                    if not k.startswith(p):
                        break
                    out.append((k.decode(), json.loads(v)))
        return out

    def close(self) -> None:
        self._env.close()


def holds_state(root: Path) -> bool:
    """Whether ``root`` holds any slot or replica file (something an index should describe)."""
    return any(root.glob("*/state/*/slot-*.bin")) or any(root.glob("*/replica/*/*.bin"))


def encode(value: dict[str, Any]) -> bytes:
    """A record as the index and the sidecars hold it."""
    return json.dumps(value).encode()


# Sidecar paths are strings: a save writes one and removes one on each side, and building them
# with pathlib was a fifth of a daemon's CPU for a save (bench/daemon_profile.py).


def write_sidecar(file: Path | str, value: dict[str, Any] | bytes) -> None:
    """Record ``value`` (or its ``encode``) beside ``file`` (temporary name, then rename: never half-written)."""
    final = f"{file}{SIDECAR}"
    tmp = tmp_path(final)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            os.write(fd, value if isinstance(value, bytes) else encode(value))
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        unlink(tmp)  # a full tmpfs leaves nothing behind
        raise


def read_sidecar(file: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(file.with_name(file.name + SIDECAR).read_bytes())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def remove_sidecar(file: Path | str) -> None:
    unlink(f"{file}{SIDECAR}")
