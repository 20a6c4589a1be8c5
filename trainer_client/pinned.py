"""Page-locking memory ffplane already has mapped (a daemon slot, a restored shard) so CUDA
copies to and from it run asynchronously at full PCIe bandwidth.

``cudaHostRegister`` pins an existing mapping in place: no second host buffer, no per-save
allocation, and the pages stay the shared-memory files the daemon reads. A slot is registered
once and reused like the slot itself. Only shared mappings are registered: Linux breaks
copy-on-write for a long-term pin of a writable private mapping, read-only or not (every page
copied), and on a huge-page tmpfs such a pin did not return. Without a CUDA device every call is
a no-op (``Registration.active`` is False), so the same code runs on CPU.
"""

from __future__ import annotations

import logging
from functools import cache

import torch

__all__ = ["Registration", "cuda_present"]

log = logging.getLogger(__name__)
_PORTABLE = 0x01  # pinned for every device of the process, not only the current one
_READ_ONLY = 0x08  # CUDA ≥ 11.1: the device only reads it (needed for a PROT_READ mapping)


@cache
def cuda_present() -> bool:
    """Whether this process can use a CUDA device (asked once: it initialises the driver)."""
    return torch.cuda.is_available()


class Registration:
    """``memory`` (a CPU tensor over a mapping we own) page-locked until ``release``.

    Holds a reference to ``memory``, so the mapping cannot be unmapped while registered (CUDA
    would keep pinning pages that no longer belong to it)."""

    def __init__(self, memory: torch.Tensor, read_only: bool = False) -> None:
        self.memory: torch.Tensor | None = memory
        self.nbytes = memory.numel() * memory.element_size()
        self.active = False
        if not cuda_present() or self.nbytes == 0 or memory.is_cuda:
            return
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(memory.data_ptr(), self.nbytes, _PORTABLE | (_READ_ONLY if read_only else 0))
        if err != cudart.cudaError.success:
            # Copies still work from pageable memory, only synchronously and slower: say so once.
            if not _warned:
                _warned.append(True)
                log.warning("cudaHostRegister of %d bytes failed (%s): copies use pageable memory (slower, synchronous)", self.nbytes, err)
            return
        self.active = True

    def release(self) -> None:
        """Unpin (idempotent); the caller has waited for every copy that used the memory."""
        if self.active and self.memory is not None:
            torch.cuda.cudart().cudaHostUnregister(self.memory.data_ptr())
        self.active = False
        self.memory = None


_warned: list[bool] = []  # the failed-registration warning, once per process
