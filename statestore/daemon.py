"""The node daemon: wires the data cache, the control socket and the read-only ops HTTP API."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import IO, Any

from fastapi import Depends, FastAPI, HTTPException, Response

from dataserver.httpserver import BearerAuth
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from statestore import shm
from statestore.config import DaemonConfig
from statestore.control import ControlServer
from statestore.heartbeat import Heartbeat
from statestore.data_cache import DataCache
from statestore.index import Index
from statestore.metrics import registry_for
from statestore.slots import SlotStore
from statestore.state_service import DurableConfig, StateService

log = logging.getLogger(__name__)


class Daemon:
    """Everything one node daemon owns. ``prepare()`` runs before serving and may refuse."""

    def __init__(self, config: DaemonConfig, token: str | None) -> None:
        config.validate()
        self.config = config
        self.token = token
        self._lock: IO[bytes] | None = None
        self.index: Index | None = None
        self.cache: DataCache | None = None
        self.state: StateService | None = None
        self.control: ControlServer | None = None
        self.heartbeat: Heartbeat | None = None
        self.address = ""  # the ops/peer base URL, once bound
        self._tasks: list[asyncio.Task[None]] = []

    def prepare(self) -> None:
        """Lock the root, reclaim stale files, reattach, and check the tmpfs has room."""
        root = self.config.root
        self._lock = shm.acquire_root(root)
        stale = shm.reclaim_stale(root)
        self.index = Index(root)
        self.cache = DataCache(self.config, self.index, self.token)
        kept, dropped = self.cache.reattach()
        cache = self.cache
        slots = SlotStore(root, self.index, self.config.budget_bytes, cache.cached_bytes)
        cache.other_bytes = slots.slot_bytes
        versions = slots.reattach()
        self.state = StateService(root, slots, DurableConfig(self.config.durable_dir, self.config.durable_every))
        shm.check_room(root, self.config.budget_bytes, already_ours=cache.cached_bytes() + slots.slot_bytes())
        log.info("root ready", extra={"root": str(root), "reattached_steps": kept, "reattached_versions": versions, "dropped": dropped, "stale_tmp": stale})

    async def start(self) -> None:
        assert self.cache is not None
        await self.cache.start()
        assert self.state is not None
        self.heartbeat = Heartbeat(self.config, self.state.slots, self.token)
        self.heartbeat.address = self.address
        self.control = ControlServer(self.cache, self.state, self.config.socket_path, self.heartbeat)
        await self.control.start()
        self._tasks.append(asyncio.create_task(self.heartbeat.run(), name="heartbeat"))
        log.info("control socket ready", extra={"socket": str(self.config.socket_path)})

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.control is not None:
            await self.control.close()
        if self.cache is not None:
            await self.cache.close()
        if self.state is not None:
            await self.state.close()
            self.state.slots.close()
        if self.index is not None:
            self.index.close()
        if self._lock is not None:
            self._lock.close()


def create_app(daemon: Daemon) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await daemon.start()
        yield
        await daemon.stop()

    app = FastAPI(title="ffplane statestore (ops, read-only)", version="0.1.0", lifespan=lifespan)

    @app.get("/v1/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/cache")
    def cache() -> dict[str, Any]:
        """What is cached per dp rank and step, bytes, hits/misses and prefetch lag."""
        assert daemon.cache is not None
        c = daemon.cache
        return {
            "root": str(daemon.config.root),
            "window": daemon.config.window,
            "budget_bytes": daemon.config.budget_bytes,
            "bytes": c.cached_bytes(),
            "fetched_bytes": c.bytes_fetched,
            "streams": [s.describe(daemon.config.window) for s in c.streams.values()],
        }

    @app.get("/v1/state")
    def state() -> dict[str, Any]:
        """Roles, committed versions (step, bytes, checksum, slot), unique and razored bytes,
        slot use, and the latency of each save's blocking part and of its commit."""
        assert daemon.state is not None
        slots = daemon.state.slots
        return {
            "slot_bytes": slots.slot_bytes(),
            "budget_bytes": daemon.config.budget_bytes,
            "durable_dir": str(daemon.config.durable_dir) if daemon.config.durable_dir else None,
            "durable_every": daemon.config.durable_every,
            "durable_written": daemon.state.durable_written,
            "node_id": daemon.config.node_id,
            "coordinator": daemon.heartbeat.view if daemon.heartbeat else {},
            "roles": slots.describe(),
        }

    @app.get("/v1/state/{job}/{role}/{step}/shard", dependencies=[Depends(BearerAuth(daemon.token))])
    async def shard(job: str, role: str, step: int) -> Response:
        """The raw bytes of a committed shard (needs the job's token)."""
        assert daemon.state is not None
        slots = daemon.state.slots
        rs = slots.roles.get((job, role))
        version = rs.versions.get(step) if rs else None
        if rs is None or version is None:
            raise HTTPException(404, f"no committed shard of {role} at step {step} in job {job!r}")
        view = memoryview(slots.mapped(version.path))[: version.nbytes]
        data = await asyncio.to_thread(bytes, view)
        # A save reusing this slot first drops the version (on this event loop); if the version
        # is still there after the copy, no byte of it changed meanwhile.
        if rs.versions.get(step) is not version:
            raise HTTPException(409, f"step {step} of {role} was replaced while being read; ask again")
        return Response(data, media_type="application/octet-stream", headers={"X-FFplane-Checksum": version.checksum})

    registry = None

    @app.get("/metrics")
    def metrics() -> Response:
        nonlocal registry
        assert daemon.cache is not None and daemon.state is not None
        registry = registry or registry_for(daemon.cache, daemon.state.slots)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
