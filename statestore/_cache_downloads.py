"""The cache's requests to data servers: a job's view, and the batches of steps, one or a run of
small ones per request (the data server's ``GET /v1/jobs/{job}/batches?start=&count=``: one Arrow
IPC stream of ``count`` record batches either way), each from the server its turn falls to or at
once from the next one; a body is counted in the budget before it is written, checked, and
published as one file of the stream.

A single step and a run differ only in their body: a step's is streamed into its file as it
arrives (it may be large), its size checked; a run's (small steps, ``RUN_STEP_BYTES`` at most a
step) is gathered, checked to hold exactly the steps asked for (``check_run``), then written.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pyarrow as pa

from ffplane_contract.auth import bearer
from ffplane_contract.dataserver_http import JobView
from ffplane_contract.errors import CapacityError, FFPlaneError, TransportError, error_from
from ffplane_contract.files import step_file
from statestore import shm
from statestore._cache_admission import Admission, PutOff, Reservation
from statestore._cache_streams import CachedFile, Stream, index_key
from statestore.config import DaemonConfig
from statestore.dataservers import DataServers, read_answer
from statestore.index import Index
from statestore.job_plans import file_generations, generations_of

_T = TypeVar("_T")
# Refuses fetched steps planned before the job's plan: (stream, first step, each step's generation)
PlanCheck = Callable[[Stream, int, "tuple[int, ...] | None"], Awaitable[None]]

_CONNECT_S = 2.0  # a data server that takes no connection this long is passed over (sends nothing: --fetch-read-timeout-s)
RUN_STEP_BYTES = 256 << 10  # steps at most this big are prefetched ``fetch_steps`` per request


class RunTooLarge(FFPlaneError):
    """A run's body is past what runs are for (steps grew since the estimate): its steps are
    fetched one by one, each within the budget like any large step. Not the server's fault."""

    status = 413


def _what(stream: Stream, steps: list[int]) -> str:
    """The steps of a request, as its errors name them (made only for an error)."""
    return f"{stream.key} step {steps[0]}" if len(steps) == 1 else f"{stream.key} steps {steps[0]}+{len(steps)}"


class Downloads:
    """Requests to ``servers`` over one session (``start`` opens it, ``close`` ends it); files
    published under ``config.root``, recorded in ``index``, their room held in ``admission``,
    each checked by ``check`` before it is published."""

    def __init__(
        self, config: DaemonConfig, servers: DataServers, token: str | None, index: Index, admission: Admission, check: PlanCheck
    ) -> None:
        self.config = config
        self.servers = servers
        self.token = token
        self.index = index
        self._admission = admission
        self._check = check
        self._session: aiohttp.ClientSession | None = None
        self.bytes_fetched = 0

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            # a server that died without a reset (its host lost) is passed over after these
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=_CONNECT_S, sock_read=self.config.fetch_read_timeout_s),
            connector=aiohttp.TCPConnector(limit=self.config.fetch_concurrency * 2),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def failing_over(self, servers: list[str], fetch: Callable[[str], Awaitable[_T]]) -> _T:
        """``fetch`` from each of ``servers`` in turn until one answers; only a server that does
        not answer or answers 5xx is passed over (not for room this daemon lacks: ``PutOff``,
        ``CapacityError``)."""
        error: FFPlaneError | None = None
        for server in servers:
            try:
                got = await fetch(server)
            except FFPlaneError as exc:
                if isinstance(exc, (PutOff, CapacityError)) or not (isinstance(exc, TransportError) or exc.status >= 500):
                    raise
                self.servers.failed(server)
                error = exc
                continue
            self.servers.answered(server)
            return got
        assert error is not None
        raise error

    # --- the job's view ------------------------------------------------------------------
    async def job_view(self, stream: Stream) -> JobView:
        """The job's view from the first data server that answers (ValueError: not a view)."""
        return await self.failing_over(self.servers.for_step(stream.key, 0), lambda server: self._job_view_from(server, stream))

    async def _job_view_from(self, server: str, stream: Stream) -> JobView:
        assert self._session is not None
        try:
            async with self._session.get(f"{server}/v1/jobs/{stream.job}", headers=bearer(stream.token or self.token)) as resp:
                if resp.status != 200:
                    detail = (await resp.text())[:500]
                    raise error_from(resp.status, f"data server answered {resp.status} for job {stream.job!r}: {detail}")
                return JobView.model_validate_json(await read_answer(resp))
        except aiohttp.ClientError as exc:
            raise TransportError(f"cannot fetch job {stream.job!r} from {server}: {exc}") from exc

    # --- batches -------------------------------------------------------------------------
    async def download(self, stream: Stream, steps: list[int]) -> CachedFile:
        """Fetch ``steps`` (consecutive) as one file from the data server their turn falls to, or
        at once from the next one when that one does not answer or answers 5xx (the same bytes: a
        batch is a pure function of its TID). A run's servers take turns by run
        (``DataServers.for_run``)."""
        key, first = stream.key, steps[0]
        servers = self.servers.for_step(key, first) if len(steps) == 1 else self.servers.for_run(key, first, self.config.fetch_steps)
        final = stream.directory / step_file(first)
        tmp = shm.tmp_path(final)
        return await self.failing_over(servers, lambda server: self._download_from(server, stream, steps, tmp, final))

    async def _download_from(self, server: str, stream: Stream, steps: list[int], tmp: Path, final: Path) -> CachedFile:
        assert self._session is not None
        url = f"{server}/v1/jobs/{stream.job}/batches"
        params = {"dp_rank": str(stream.dp_rank), "start": str(steps[0]), "count": str(len(steps))}
        stream.requests += 1
        # Every byte is counted before it is written: the announced size up front, or, for a body
        # sent without one (a step over 16 MiB is streamed), what has arrived, chunk by chunk.
        with self._admission.reservation(stream, steps[0]) as res:  # held until its file is published
            try:
                async with self._session.get(url, params=params, headers=bearer(stream.token or self.token)) as resp:
                    if resp.status != 200:
                        detail = (await resp.text())[:500]
                        raise error_from(resp.status, f"data server answered {resp.status} for {_what(stream, steps)}: {detail}")
                    if len(steps) == 1:
                        nbytes, gens = await self._receive_step(resp, res, tmp)
                    else:
                        nbytes, gens = await self._receive_run(resp, res, steps, tmp, server)
            except aiohttp.ClientError as exc:
                shm.unlink(tmp)
                raise TransportError(f"cannot fetch {_what(stream, steps)} from {server}: {exc}") from exc
            except OSError as exc:  # ENOSPC: the tmpfs is full — a clear error, not a dropped reader
                shm.unlink(tmp)
                what = _what(stream, steps)
                raise CapacityError(f"cannot cache {what} in {self.config.root}: {exc}; the tmpfs is full") from exc
            except BaseException:
                shm.unlink(tmp)
                raise
            try:
                await self._check(stream, steps[0], gens)
            except BaseException:
                shm.unlink(tmp)
                raise
            return self._publish(res, tmp, final, nbytes, len(steps), gens)

    async def _receive_step(self, resp: aiohttp.ClientResponse, res: Reservation, tmp: Path) -> tuple[int, tuple[int, ...] | None]:
        """One step's body, streamed into ``tmp``: its size, and its generation."""
        stream, admission = res.stream, self._admission
        res.size = resp.content_length
        if res.size is not None:
            stream.step_bytes = res.size
            await admission.hold(res, res.size)
        received = 0

        async def before_write(n: int) -> None:
            nonlocal received
            received += n
            if res.size is None:  # what a step is at least, for the prefetch's estimate
                stream.step_bytes = max(stream.step_bytes, received)
            await admission.hold(res, received)
            if admission.gate is not None:
                await admission.admit(res, n)

        fd = shm.open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            shm.presize(fd, res.size or 0)
            nbytes = await _copy_body(resp, fd, before_write)
        finally:
            os.close(fd)
        if res.size is not None and nbytes != res.size:
            raise TransportError(f"{stream.key} step {res.step}: body of {nbytes} bytes, Content-Length said {res.size}")
        stream.step_bytes = nbytes
        return nbytes, file_generations(tmp, 1)

    async def _receive_run(
        self, resp: aiohttp.ClientResponse, res: Reservation, steps: list[int], tmp: Path, server: str
    ) -> tuple[int, tuple[int, ...] | None]:
        """A run's body, gathered, checked to hold exactly ``steps`` and written to ``tmp``: its
        size, and each step's generation."""
        stream, admission, size = res.stream, self._admission, resp.content_length
        cap = len(steps) * RUN_STEP_BYTES  # what a run is for; bigger steps go one by one, each within the budget
        if size is not None and size > cap:
            raise RunTooLarge(f"{_what(stream, steps)} are over {RUN_STEP_BYTES >> 10} KiB a step now")
        res.size = size
        await admission.hold(res, size if size is not None else cap)  # the room of the whole body
        chunks: list[bytes] = []
        got = 0
        async for chunk, _ in resp.content.iter_chunks():
            got += len(chunk)
            if got > cap:
                raise RunTooLarge(f"{_what(stream, steps)} are over {RUN_STEP_BYTES >> 10} KiB a step now")
            await admission.hold(res, got)  # (only looks whether its room was taken back)
            if admission.gate is not None:
                await admission.admit(res, len(chunk))
            chunks.append(chunk)
        body = b"".join(chunks)
        if size is not None and len(body) != size:
            raise TransportError(f"{_what(stream, steps)}: body of {len(body)} bytes, Content-Length said {size}")
        try:
            gens = check_run(body, steps)
        except (ValueError, pa.ArrowException) as exc:
            raise TransportError(f"{_what(stream, steps)} from {server}: {exc}") from exc
        fd = shm.open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            shm.presize(fd, len(body))
            writer = shm.PageWriter(fd)
            writer.add(memoryview(body))
            writer.flush()
        finally:
            os.close(fd)
        stream.step_bytes = len(body) // len(steps)
        return len(body), gens

    def _publish(
        self, res: Reservation, tmp: Path, final: Path, nbytes: int, count: int, generations: tuple[int, ...] | None
    ) -> CachedFile:
        """A file of ``count`` steps from ``res.step``, written whole under ``tmp``, becomes
        ``final`` and is recorded (with the generation each step was planned in); the fetch's
        room becomes the file's in the same breath."""
        stream = res.stream
        shm.publish(tmp, final)
        record: dict[str, Any] = {"file": str(final.relative_to(self.config.root)), "nbytes": nbytes}
        if count > 1:
            record["steps"] = count
        if generations is not None:
            record["generations"] = list(generations)
        self.index.put(index_key(stream.job, stream.dp_rank, res.step), record)
        self.bytes_fetched += nbytes
        cached = CachedFile(final, nbytes, res.step, count, generations)
        stream.add(cached)
        self._admission.release(res)
        return cached


async def _copy_body(resp: aiohttp.ClientResponse, fd: int, before_write: Callable[[int], Awaitable[None]]) -> int:
    """Write the body to ``fd`` as it arrives; returns its size. ``before_write`` is awaited with
    each chunk's size before the chunk is written (room in the budget, the link gate).

    Chunks are taken as aiohttp buffered them (``iter_chunks`` pops them; ``iter_any`` would
    join them, a copy) and written whole huge pages at a time (``shm.PageWriter``), on the
    event loop: a worker thread overlapped the writes with the next receive, but its GIL
    hand-offs cost more than the overlap saved on 2 cores (64 futex calls and ~1 ms of system
    time per 4 MiB step).
    """
    out = shm.PageWriter(fd)
    async for chunk, _ in resp.content.iter_chunks():
        await before_write(len(chunk))
        out.add(chunk)
    out.flush()
    return out.offset


def check_run(body: bytes, steps: list[int]) -> tuple[int, ...] | None:
    """ValueError unless ``body`` is one Arrow IPC stream holding exactly ``steps``' record
    batches, in order (each batch's ``step`` metadata says which): what a cached file of a run,
    read by ``trainer_client``'s daemon source, must be. Returns the generation each step was
    planned in (None: untagged)."""
    reader = pa.ipc.open_stream(pa.py_buffer(body))
    metas = []
    for step in steps:
        try:
            meta = reader.read_next_batch_with_custom_metadata().custom_metadata
        except StopIteration:
            raise ValueError(f"the stream ends before step {step}") from None
        said = None if meta is None else meta.get(b"step")
        if said != str(step).encode():
            raise ValueError(f"the stream's batch for step {step} says step {said!r}")
        metas.append(meta)
    try:
        reader.read_next_batch()
    except StopIteration:
        return generations_of(metas)
    raise ValueError(f"the stream holds more than the {len(steps)} steps asked for")
