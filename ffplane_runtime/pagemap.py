"""Populate page tables of a mapping ahead of use (``MADV_POPULATE_READ``/``_WRITE``, Linux >= 5.14).

A fresh mapping of pages already in memory (tmpfs, page cache) otherwise takes one minor fault
per 4 KiB page on first touch, which caps reads of a fresh mapping well below memcpy speed.
ctypes drops the GIL for the call (``mmap.madvise`` keeps it), so a background thread can do it.
On older kernels the call fails with EINVAL and pages fault in lazily as before.
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

_MADV_POPULATE_READ = 22
_MADV_POPULATE_WRITE = 23
_libc: Any = None


def populate_read(address: int, size: int) -> bool:
    """Map ``size`` bytes at ``address`` (page-aligned) readable now; False if unsupported."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            _libc = False
    if not _libc or not size:
        return False
    return int(_libc.madvise(address, size, _MADV_POPULATE_READ)) == 0


def populate_write(mm: mmap.mmap) -> bool:
    """Fault a shared writable mapping's pages in now, in one call, rather than one fault per
    4 KiB as bytes land in it (a slot before a save's copy, a replica file before a receive);
    False if the kernel does not support it."""
    try:
        mm.madvise(_MADV_POPULATE_WRITE)
    except (OSError, ValueError):
        return False
    return True
