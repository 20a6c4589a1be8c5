"""shm.PageWriter: a streamed body written so that no fresh huge page is zeroed by the kernel."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from statestore import shm

Pwritev = Callable[[int, list[memoryview], int], int]


def _chunks(total: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, total, dtype=np.uint8).tobytes()
    out, at = [], 0
    while at < total:
        n = int(rng.integers(1, 300_000))  # aiohttp hands over chunks of any size
        out.append(data[at : at + n])
        at += n
    return out


def _write(
    path: Path, chunks: list[bytes], monkeypatch: pytest.MonkeyPatch, wrap: Callable[[Pwritev], Pwritev]
) -> tuple[shm.PageWriter, bytearray]:
    monkeypatch.setattr(os, "pwritev", wrap(os.pwritev))
    seen = bytearray()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        out = shm.PageWriter(fd, on_write=seen.extend)
        for c in chunks:
            out.add(c)
        out.flush()
    finally:
        os.close(fd)
        monkeypatch.undo()
    return out, seen


def test_the_first_write_into_every_huge_page_fills_it_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # tmpfs zeroes whatever of a fresh page its first write leaves uncovered (shmem_write_end):
    # 1 MiB writes had the kernel zero half of every 2 MiB page.
    chunks = _chunks(5 * shm.HUGE_PAGE + 12_345, seed=1)
    writes: list[tuple[int, int]] = []

    def recording(real: Pwritev) -> Pwritev:
        def call(fd: int, views: list[memoryview], offset: int) -> int:
            n = real(fd, views, offset)
            writes.append((offset, n))
            return n

        return call

    path = tmp_path / "step"
    out, seen = _write(path, chunks, monkeypatch, recording)
    body = b"".join(chunks)
    assert path.read_bytes() == body and bytes(seen) == body and out.offset == len(body)
    last_page = (len(body) - 1) // shm.HUGE_PAGE
    first_write: dict[int, tuple[int, int]] = {}
    for offset, n in writes:
        for page in range(offset // shm.HUGE_PAGE, (offset + n - 1) // shm.HUGE_PAGE + 1):
            first_write.setdefault(page, (offset, offset + n))
    assert sorted(first_write) == list(range(last_page + 1))
    for page, (start, end) in first_write.items():
        if page < last_page:
            assert start <= page * shm.HUGE_PAGE and end >= (page + 1) * shm.HUGE_PAGE, (page, start, end)


def test_short_writes_lose_and_repeat_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    chunks = _chunks(3 * shm.HUGE_PAGE + 7, seed=2)

    def short(real: Pwritev) -> Pwritev:
        def call(fd: int, views: list[memoryview], offset: int) -> int:
            head = bytes(views[0])[: max(1, len(views[0]) // 3)]
            return real(fd, [memoryview(head)], offset)  # a third of the first piece, at most

        return call

    path = tmp_path / "step"
    out, seen = _write(path, chunks, monkeypatch, short)
    body = b"".join(chunks)
    assert path.read_bytes() == body and bytes(seen) == body and out.offset == len(body)


def test_a_failed_write_keeps_the_unwritten_bytes_pending_and_unhashed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    chunks = _chunks(3 * shm.HUGE_PAGE, seed=3)
    real = os.pwritev
    calls = {"n": 0}

    def failing_once(fd: int, views: list[memoryview], offset: int) -> int:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return real(fd, views, offset)

    monkeypatch.setattr(os, "pwritev", failing_once)
    seen = bytearray()
    path = tmp_path / "step"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    added = 0
    try:
        out = shm.PageWriter(fd, on_write=seen.extend)
        with pytest.raises(OSError):
            for c in chunks:
                added += 1
                out.add(c)
        body = b"".join(chunks[:added])
        assert 0 < out.offset < len(body) and bytes(seen) == body[: out.offset]  # what the hash has is on disk
        out.flush()  # room again: the rest follows, nothing lost or doubled
        assert bytes(seen) == body and out.offset == len(body)
    finally:
        os.close(fd)
    assert path.read_bytes() == body
