"""The daemon's writes to the durable tier (the format, and reading it: ``ffplane_contract.durable``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ffplane_contract.durable import encode_head, shard_path, step_dir
from statestore.shm import open_private, private_dir


def write_shard(
    root: Path,
    job: str,
    role: str,
    step: int,
    data: memoryview,
    digest: str,
    header: dict[str, Any],
    admit: Callable[[int], None] | None = None,
    chunk: int = 4 << 20,
) -> Path:
    """Write one shard file (temp file, fsync, rename). ``admit(n)`` is called before each chunk
    of ``n`` bytes: the daemon's link gate, when the durable directory is a network file system."""
    private_dir(step_dir(root, job, step))  # 0700 from --durable-dir down, where created
    final = shard_path(root, job, role, step)
    tmp = final.with_name(final.name + f".tmp-{os.getpid()}")
    with open(tmp, "wb", opener=open_private) as f:  # 0600
        f.write(encode_head(job, role, step, len(data), digest, header))
        for at in range(0, len(data), chunk):
            if admit is not None:
                admit(min(chunk, len(data) - at))
            f.write(data[at : at + chunk])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return final
