"""The daemon's LMDB index: what is where in shared memory, so a restart can reattach.

One environment per root (``<root>/_index``), keys ``<kind>/<job>/...`` and JSON values. It sits
on the same tmpfs as the data it describes: both survive a daemon crash, both go with a reboot.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lmdb


class Index:
    def __init__(self, root: Path, map_size: int = 1 << 30) -> None:
        path = root / "_index"
        path.mkdir(parents=True, exist_ok=True)
        # sync=False: a process crash keeps every committed transaction (it is in the page
        # cache); only a machine crash could lose some, and that loses the tmpfs data anyway.
        self._env = lmdb.open(str(path), map_size=map_size, sync=False, metasync=False, max_dbs=0)

    def put(self, key: str, value: dict[str, Any], replacing: Iterable[str] = ()) -> None:
        """Store ``value`` at ``key`` and delete the keys it replaces, in one transaction."""
        with self._env.begin(write=True) as txn:
            txn.put(key.encode(), json.dumps(value).encode())
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
