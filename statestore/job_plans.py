"""Which generation of its job each step is planned in, as the node cache knows it.

A job's plan changes only by gaining a generation (an elastic change from a step on): from its
``start_step`` every step is planned anew (``ffplane_contract.plan``, the rule the reader applies too). The data server tags each batch with the generation it
was planned in (its start step, in the batch's ``generation`` metadata); the cache keeps those tags
with each file it publishes (``file_generations``, or ``check_run``'s for a run) and the job's
generations from the data server's job view (``GET /v1/jobs/{job}``: ``fetch_plan``). A cached
step whose tag is older than the generation the job now plans it in was fetched before the change:
the cache drops it and fetches it again (``DataCache.check_plan``). A tag newer than the plan says
the plan is behind: the job gained a generation since it was fetched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import pyarrow as pa


def generations_of(metas: Sequence[Mapping[bytes, bytes] | None]) -> tuple[int, ...] | None:
    """The ``generation`` tags of a file's batches, one a step; None if one lacks it (a file
    written by something other than a data server: never checked)."""
    out = []
    for meta in metas:
        raw = None if meta is None else meta.get(b"generation")
        if raw is None:
            return None
        try:
            out.append(int(raw))
        except ValueError:
            return None
    return tuple(out)


def file_generations(path: Path, count: int) -> tuple[int, ...] | None:
    """The tags of the ``count`` batches of the IPC stream at ``path``: read from a mapping of its
    headers (the batches' buffers are not touched); None if it is not such a stream."""
    metas: list[Mapping[bytes, bytes] | None] = []
    try:
        with pa.memory_map(str(path)) as source:
            reader = pa.ipc.open_stream(source)
            for _ in range(count):
                metas.append(reader.read_next_batch_with_custom_metadata().custom_metadata)
    except (pa.ArrowException, OSError, StopIteration):
        return None
    return generations_of(metas)
