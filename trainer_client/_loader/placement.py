"""Pinning and device placement of each step's tensors, on the thread that reads the step."""

from __future__ import annotations

import torch

from trainer_client._device_copy import stage
from trainer_client._loader.part import Fetched, Part, Stage
from trainer_client.pinned import cuda_present


def resolve_device(device: str | torch.device | None) -> torch.device | None:
    """The device tensor columns are moved to (None: they stay where the cache maps them)."""
    if device is None:
        return None
    dev = torch.device(device)
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        raise ValueError(f"DataLoader(device={device!r}): batches go to 'cpu' or a CUDA device")
    if not cuda_present():
        raise ValueError(f"DataLoader(device={device!r}): torch sees no CUDA device here; pass device='cpu' (or leave it out)")
    # resolved here, on the training thread: the look-ahead thread's current device is always 0
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


class Placement(Stage[Fetched]):
    """With a ``device``, each step's tensor columns are copied onto it as the step is read (into
    page-locked host memory, then non-blocking on a side stream; binary columns stay on the host);
    with ``pin_memory``, into page-locked host memory. Read on the look-ahead thread, the copy of
    step s + 1 runs while step s trains; ``Fetched.tensors()`` on the training thread waits for
    it. With neither, a pass-through. No state of its own."""

    def __init__(self, upstream: Part[Fetched], device: torch.device | None, pin_memory: bool) -> None:
        super().__init__(upstream)
        self.device = device
        self.staging = device is not None or pin_memory

    def next(self) -> Fetched:
        item = self.upstream.next()
        if self.staging:
            item.staged = stage(item.memory.to_torch(item.batch), self.device)
        return item

    def cheap_next(self) -> bool:
        return not self.staging and self.upstream.cheap_next()  # a copy is never cheap
