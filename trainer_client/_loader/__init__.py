"""The DataLoader's parts, each small, each resumable, composed by ``trainer_client.DataLoader``:

    StepSource → GenerationCheck → Placement → LookAhead → (the loader's hand-out) → MicroBatches

- ``StepSource`` (``source.py``): step → batch, from the node daemon's cache or the data server.
- ``GenerationCheck`` (``generations.py``): over the data server, each batch is the job's current
  plan's (over the daemon, the daemon checks: it owns the cache).
- ``Placement`` (``placement.py``): page-locked host memory, or a device, on the reading thread.
- ``LookAhead`` (``look_ahead.py``): the next step read on a thread of its own; steps handed out
  held until that thread drops them.
- ``MicroBatches`` (``micro_batches.py``): each step's batch as ``k`` consecutive parts.

Every part follows ``part.Part``: ``next()``, ``state_dict()``, ``reset(state)``, ``close()``.
"""

from __future__ import annotations
