"""One data server's state, shared by its routes, and its lifecycle (``DataServer``).

The constructor builds everything complete: the dataset catalog, the job registry (files, or
etcd with ``--etcd``), the bearer token check, this server's part in coordinating the nodes
(``coordination``), the metrics, and the two worker threads of the batch path. ``startup()``
loads the jobs and starts the background loops; ``shutdown()`` stops them and releases what the
constructor opened, and is safe to call twice. ``create_app`` runs the pair as FastAPI's lifespan
(``running()``); the routes reach the server through ``request.app.state``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from dataserver.catalog import Catalog
from dataserver.config import ServeConfig
from dataserver.coordination import Coordination
from dataserver.jobs import Job, JobRegistry
from dataserver.metrics import Metrics
from dataserver.shared_jobs import EtcdJobRegistry
from ffplane_contract.errors import InvalidError
from ffplane_runtime.etcd import Etcd
from ffplane_runtime.httpserver import BearerAuth

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class DataServer:
    def __init__(self, config: ServeConfig, token: str | None) -> None:
        """``token``: the job's, which the entry point read (None: every request is refused, 503)."""
        self.config = config
        self.catalog = Catalog(config.data_dir)
        self.etcd = Etcd(config.etcd) if config.etcd else None
        state_dir = config.resolved_state_dir()
        self.jobs: JobRegistry = JobRegistry(state_dir) if self.etcd is None else EtcdJobRegistry(self.etcd, state_dir)
        self.auth = BearerAuth(token)
        self.coordination = Coordination(config, self.auth.token, self.etcd)
        self.metrics = Metrics()
        self.metrics.watch(self.coordination.coordinator, lambda: self.coordination.leading)
        # Batches are encoded on the event loop, step by step (~0.5 ms per 4 MiB): with a thread
        # per concurrent request the GIL changed hands ~250 times per step (futex storm, 2.6 ms of
        # system time), and even one encoder thread's hand-offs cost more than they overlapped on
        # 2 cores (docs/decisions.md, "Data path, fourth pass"). Opening a dataset, which can take
        # seconds, still runs off the loop, on this one thread; steps too big to encode without
        # stalling the loop run on the other.
        self.opener = ThreadPoolExecutor(1, thread_name_prefix="open-dataset")
        self.big_steps = ThreadPoolExecutor(1, thread_name_prefix="encode-big-step")
        self._stopped = False

    # --- lifecycle ----------------------------------------------------------------------------
    async def startup(self) -> None:
        """Load the jobs (a record that cannot be used breaks only its job) and start the loops."""
        names = self.jobs.load(self._num_samples_of)
        log.info(
            "dataserver ready",
            extra={"datasets": self.catalog.names(), "jobs": names, "broken_jobs": sorted(set(self.jobs.names()) - set(names))},
        )
        await self.coordination.start()

    async def shutdown(self) -> None:
        """Stop the loops, hand the lead over, let the worker threads finish, close the datasets."""
        if self._stopped:
            return
        self._stopped = True
        await self.coordination.stop()
        self.opener.shutdown(wait=True, cancel_futures=True)
        self.big_steps.shutdown(wait=True, cancel_futures=True)
        self.catalog.close()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """``startup()``, then ``shutdown()`` when the block ends (FastAPI's lifespan)."""
        await self.startup()
        try:
            yield
        finally:
            await self.shutdown()

    def _num_samples_of(self, dataset: str) -> int:
        return self.catalog.get(dataset).num_samples

    # --- what several routes need -------------------------------------------------------------
    async def registry(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)``, a call of the job registry from an async route: inline for the file
        registry, off the loop for etcd (a network round trip)."""
        return fn(*args) if self.etcd is None else await asyncio.to_thread(fn, *args)

    async def job(self, name: str) -> Job:
        """Job ``name`` (a job another data server created is read first); NotFoundError if there
        is none, ConflictError if its record is broken."""
        if not self.jobs.known(name):
            await self.registry(self.jobs.find, name)
        return self.jobs.get(name)

    async def sample_bytes(self, dataset: str) -> int:
        """``catalog.sample_bytes``, measured off the loop the first time."""
        known = self.catalog.known_sample_bytes(dataset)
        if known is not None:
            return known
        return await asyncio.get_running_loop().run_in_executor(self.opener, self.catalog.sample_bytes, dataset)

    def check_layout(self, dp: int, batch_per_rank: int, sample_bytes: int) -> None:
        """InvalidError if a step of this layout is more than this server serves."""
        limits = self.config
        if dp * batch_per_rank > limits.max_samples_per_step:
            raise InvalidError(
                f"dp={dp} x batch_per_rank={batch_per_rank} = {dp * batch_per_rank} samples per step exceeds "
                f"this server's limit of {limits.max_samples_per_step} (--max-samples-per-step)"
            )
        if batch_per_rank * sample_bytes > limits.max_bytes_per_request:
            raise InvalidError(
                f"one rank's step of batch_per_rank={batch_per_rank} samples of ~{sample_bytes} bytes would be "
                f"{batch_per_rank * sample_bytes} bytes, over the limit of {limits.max_bytes_per_request} bytes per "
                f"request (--max-bytes-per-request); lower batch_per_rank"
            )
