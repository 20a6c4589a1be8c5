"""Python's cyclic garbage collector held off while a save builds what it sends.

A save makes a few containers per tensor (its header entry, the slot views it copies into), none
of them garbage, and every 700 of them set off a collection; every tenth of those passes over the
older generation and, in time, one passes over every object the process has (a training process
has 10^5-10^6: torch, the model, its hooks). Held off, the save's objects meet one young collection
afterwards instead of dozens (``tests/trainer_client/test_save_collector.py``, 3,000 tensors); what
it is worth: ``python bench/save_cpu.py --cases fsdp2`` (docs/decisions.md). A steady save leaves
few objects at all (``state_codec.encode``'s ``previous``).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused() -> Iterator[None]:
    """No collection inside the block; the collector is on again afterwards if it was before
    (a caller that turned it off keeps it off). Process-wide: other threads' collections wait
    too, so keep the block to building objects, never a wait; and another thread that turns the
    collector off or on meanwhile is not coordinated with (a save on DCP's async thread)."""
    was_on = gc.isenabled()
    if was_on:
        gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
