"""Copies between host memory and CUDA devices on side streams, and the handle that says when
they are done.

A save's device → slot copies and a restore's slot → device copies run on one side stream per
device, ordered after everything already queued on the caller's current stream (the optimizer
step that produced the weights), so the caller's stream is never made to wait; an event on each
side stream marks the end. Host ↔ host pairs go to ``host_copy`` (the Checkpointer's threaded
copy), now or, with an ``executor``, on its thread. ``CopyInFlight.wait`` returns once every byte
has landed: only then may a slot be committed or a restored tensor be used.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (destination, source)
_streams: dict[int, Any] = {}  # device index → its side stream, made once per process


@dataclass
class CopyInFlight:
    events: list[Any] = field(default_factory=list)  # torch.cuda.Event per device used
    host: Future[None] | None = None  # the host pairs, when copied on an executor

    def wait(self) -> None:
        """Block until every copy has completed (re-raises a host copy's exception)."""
        if self.host is not None:
            self.host.result()
        for e in self.events:
            e.synchronize()  # releases the GIL while it waits


def side_stream(device: torch.device) -> Any:
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _streams.get(index)
    if stream is None:
        stream = _streams[index] = torch.cuda.Stream(device=index)
    return stream


def start_copies(pairs: Pairs, host_copy: Callable[[Pairs], None], executor: ThreadPoolExecutor | None = None) -> CopyInFlight:
    """Start ``d.copy_(s)`` for every pair: pairs touching a CUDA device on that device's side
    stream (non-blocking), the rest through ``host_copy``."""
    by_device: dict[torch.device, Pairs] = {}
    host: Pairs = []
    if not any(s.is_cuda or d.is_cuda for d, s in pairs):
        host = pairs  # as given: a new (d, s) per pair kept the collector busy (the tuples' free list)
    else:
        for d, s in pairs:
            if s.is_cuda or d.is_cuda:
                by_device.setdefault(s.device if s.is_cuda else d.device, []).append((d, s))
            else:
                host.append((d, s))
    flight = CopyInFlight()
    for device, device_pairs in by_device.items():
        stream = side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # after the kernels that wrote the sources
        with torch.cuda.stream(stream), torch.no_grad():
            for d, s in device_pairs:
                d.copy_(s, non_blocking=True)
                # the caching allocator must not hand these blocks to another tensor before the
                # side stream is done with them (a state may hold temporaries the caller drops)
                for t in (d, s):
                    if t.is_cuda:
                        t.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        flight.events.append(event)
    if host:
        if executor is None:
            host_copy(host)
        else:
            flight.host = executor.submit(host_copy, host)
    return flight


def copy_now(pairs: Pairs, host_copy: Callable[[Pairs], None]) -> None:
    """``start_copies`` and wait for them."""
    start_copies(pairs, host_copy).wait()


@dataclass
class StagedBatch:
    """A batch whose tensor columns are being copied onto a device (binary columns stay on the
    host), or, without a device, already copied into page-locked host memory."""

    batch: dict[str, Any]
    flight: CopyInFlight

    def take(self) -> dict[str, Any]:
        """On the training thread: the batch, its copies completed, usable on the current stream."""
        self.flight.wait()
        for v in self.batch.values():
            if isinstance(v, torch.Tensor) and v.is_cuda:
                v.record_stream(torch.cuda.current_stream(v.device))  # the caller's stream may not be the default
        return self.batch

    def release(self) -> None:
        self.flight.wait()


def stage(batch: dict[str, Any], device: torch.device | None) -> StagedBatch:
    """Copy ``batch``'s tensors into page-locked host buffers (torch's caching host allocator),
    then, with a ``device``, start copying those onto it (non-blocking, on its side stream).

    Not a registration of the cached step's mapping in place: that mapping is private
    (copy-on-write, so training code may change a batch in place), and Linux copies every page
    of a private mapping when it is pinned long-term — on a huge-page tmpfs the pin never
    returned. A batch's memcpy on the look-ahead thread costs less than either. The pinned
    buffers may go as soon as the copies are queued: the allocator reuses a block only after the
    copies recorded on it have completed."""
    out = dict(batch)
    pairs: Pairs = []
    for name, value in batch.items():
        if isinstance(value, torch.Tensor):
            host = value.pin_memory()
            if device is None:
                out[name] = host
            else:
                out[name] = torch.empty_like(value, device=device)
                pairs.append((out[name], host))
    return StagedBatch(out, start_copies(pairs, _refuse_host))


def _refuse_host(pairs: Pairs) -> None:
    raise AssertionError(f"host pairs in a device staging: {[(d.device, s.device) for d, s in pairs]}")
