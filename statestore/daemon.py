"""The node daemon: builds the data cache, the state service, the ring and the control socket in
the order they depend on each other, and serves the ops HTTP API with the peer routes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import IO, Any

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ffplane_contract.files import HINTS_DIR
from ffplane_contract.settings import version
from ffplane_contract.warm import readiness, warm_dir
from ffplane_runtime.httpserver import offline_docs
from statestore import shm
from statestore.config import DaemonConfig
from statestore.control import ControlServer
from statestore.data_cache import DataCache
from statestore.dataservers import DataServers
from statestore.heartbeat import Heartbeat
from statestore.index import Index
from statestore.latencies import Latencies
from statestore.link_gate import LinkGate
from statestore.metrics import registry_for
from statestore.rebuild import QUARANTINE, Rebuilt, rebuild, set_aside
from statestore.replicas import ReplicaStore
from statestore.ring import Replicator
from statestore.shard import CorruptCopies
from statestore.slots import SlotStore
from statestore.state_service import DurableConfig, StateService
from statestore.transport import BulkServer, BulkTransport, Transport, peer_routes

log = logging.getLogger(__name__)


class Daemon:
    """Everything one node daemon owns. ``prepare()`` runs before serving and may refuse; it
    builds what the root holds (index, gate, cache, slots, replicas). ``start()`` builds the rest
    once the port is bound (``address``, which the heartbeat announces)."""

    def __init__(self, config: DaemonConfig, token: str | None) -> None:
        config.validate()
        self.config = config
        self.token = token
        self._lock: IO[bytes] | None = None
        self.index: Index | None = None
        self.gate: LinkGate | None = None
        self.cache: DataCache | None = None
        self.slots: SlotStore | None = None
        self.replicas: ReplicaStore | None = None
        self.heartbeat: Heartbeat | None = None
        self.transport: Transport | None = None
        self.bulk: BulkServer | None = None  # the bulk port replica pushes arrive on
        self.state: StateService | None = None
        self.control: ControlServer | None = None
        self.address = ""  # the ops/peer base URL: set once bound, before start()
        self.huge_pages = "never"  # the root tmpfs's huge= option, read at prepare()
        self.latencies = Latencies()  # histograms for /metrics
        self.rebuilt: Rebuilt | None = None  # what a rebuild of a lost index found, if one ran
        self._tasks: list[asyncio.Task[None]] = []

    def prepare(self) -> None:
        """Lock the root, reclaim stale files, reattach, and check the tmpfs has room. A refused
        start leaves the root as it found it (no lock file, no index or hints folder it created)."""
        root = self.config.root
        created_root, had = not root.exists(), {d for d in ("_index", HINTS_DIR) if (root / d).exists()}
        self._lock = shm.acquire_root(root)
        try:
            self._prepare(root)
        except BaseException:
            self._undo(root, created_root, had)
            raise

    def _undo(self, root: Path, created_root: bool, had: set[str]) -> None:
        if self.gate is not None:
            self.gate.close()
            self.gate = None
        if self.index is not None:
            self.index.close()
            self.index = None
        for made in {"_index", HINTS_DIR} - had:
            shutil.rmtree(root / made, ignore_errors=True)
        (root / "daemon.lock").unlink(missing_ok=True)
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        if created_root:
            with contextlib.suppress(OSError):
                root.rmdir()  # only if this start left nothing else in it

    def _open_index(self, root: Path) -> Index:
        """The root's index; a damaged or missing one is rebuilt from the slot and replica files."""
        index, problem = Index.open_checked(root)
        if index is not None:
            return index
        stamp = time.strftime("%Y%m%dT%H%M%S")
        old = set_aside(root, root / "_index", stamp) if (root / "_index").exists() else None
        index = Index(root)
        self.rebuilt = rebuild(root, index, stamp)
        log.warning(
            f"the index was {problem}: rebuilt it from the slot and replica files; what could not be verified is in "
            f"{root / QUARANTINE / stamp} (delete it once looked at: it takes room in the tmpfs)",
            extra={
                "versions": self.rebuilt.versions,
                "replicas": self.rebuilt.replicas,
                "quarantined": self.rebuilt.quarantined,
                "old_index": old,
            },
        )
        return index

    def _prepare(self, root: Path) -> None:
        stale = shm.reclaim_stale(root)
        self.index = self._open_index(root)
        self.gate = LinkGate(self.config.gate, root)
        self.servers = DataServers(self.config.dataserver)
        self.cache = cache = DataCache(self.config, self.index, self.token, self.gate, self.servers)
        kept, dropped = cache.reattach()
        budget = self.config.budget_bytes
        # the three share one budget: each asks the others what they hold when it needs room
        self.replicas = replicas = ReplicaStore(
            root, self.index, lambda: budget - cache.cached_bytes() - slots.slot_bytes() - replicas.held_bytes()
        )
        self.slots = slots = SlotStore(root, self.index, budget, lambda: cache.cached_bytes() + replicas.held_bytes())
        cache.other_bytes = lambda: slots.slot_bytes() + replicas.held_bytes()
        versions = slots.reattach()
        held = replicas.reattach()
        self._fit_budget(budget)
        shm.check_room(root, budget, already_ours=cache.cached_bytes() + slots.slot_bytes() + replicas.held_bytes())
        self.huge_pages = shm.huge_pages(root)
        if self.huge_pages not in ("within_size", "always"):
            log.info(
                "the root's tmpfs has 4 KiB pages: readers map cached steps at about half the speed they "
                "would on a tmpfs mounted with huge=within_size (see docs/deployment.md)",
                extra={"root": str(root), "huge": self.huge_pages},
            )
        log.info(
            "root ready",
            extra={
                "root": str(root),
                "huge_pages": self.huge_pages,
                "reattached_steps": kept,
                "reattached_versions": versions,
                "reattached_replicas": held,
                "dropped": dropped,
                "stale_tmp": stale,
            },
        )

    def _fit_budget(self, budget: int) -> None:
        """A root reattached under a smaller ``--budget-mb`` than it holds: cached data steps go
        (they are fetched again when read), said in one line; checkpoint slots and replicas are
        never dropped to fit, so a budget below them is refused, naming what they hold."""
        assert self.cache is not None and self.slots is not None and self.replicas is not None
        state = self.slots.slot_bytes() + self.replicas.held_bytes()
        cached = self.cache.cached_bytes()
        if cached + state <= budget:
            return
        mib = 1 << 20
        if state > budget:
            raise shm.ShmError(
                f"{self.config.root} holds {self.slots.slot_bytes() / mib:.0f} MiB of checkpoint slots and "
                f"{self.replicas.held_bytes() / mib:.0f} MiB of replicas, more than --budget-mb {budget // mib}: start with "
                f"--budget-mb {-(-state // mib)} or more (the checkpoints are kept), or empty the root to start without them"
            )
        dropped = self.cache.shrink(budget - state)
        log.warning(
            f"the root held {(cached + state) / mib:.0f} MiB, more than --budget-mb {budget // mib}: dropped {dropped / mib:.0f} MiB "
            "of cached data steps (fetched again when read); checkpoint slots and replicas kept",
            extra={"root": str(self.config.root), "budget_bytes": budget, "dropped_bytes": dropped, "state_bytes": state},
        )

    async def start(self) -> None:
        assert self.cache is not None and self.gate is not None and self.slots is not None and self.replicas is not None
        cfg, slots, replicas = self.config, self.slots, self.replicas
        await self.cache.start()
        self.heartbeat = Heartbeat(cfg, slots, replicas, self.address, self.token, self.servers)
        self.transport = BulkTransport(self.gate, self.token)
        await self.transport.start()
        if cfg.bulk_port >= 0:
            self.bulk = BulkServer(self.token, replicas, cfg.budget_bytes)
            port = await self.bulk.start(cfg.host, cfg.bulk_port)
            log.info("bulk port ready", extra={"bulk_port": port})
        corrupt = CorruptCopies(cfg.node_id, slots, replicas)
        replicator = None
        if cfg.replicate:
            replicator = Replicator(
                cfg.node_id,
                slots,
                replicas,
                self.heartbeat,
                self.transport,
                cfg.replica_max_lag,
                cfg.replica_wait_s,
                corrupt.quarantine,
                self.latencies.replication.observe,
            )
        self.state = StateService(
            cfg.root,
            slots,
            replicas,
            DurableConfig(cfg.durable_dir, cfg.durable_every),
            node_id=cfg.node_id,
            transport=self.transport,
            corrupt=corrupt,
            replicator=replicator,
            gate=self.gate,
            dataservers=self.servers,
            token=self.token,
            latencies=self.latencies,
        )
        if replicator is not None:
            self._tasks.append(asyncio.create_task(replicator.run(), name="replicator"))
        self.control = ControlServer(self.cache, self.state, cfg.socket_path, self.heartbeat)
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
        if self.bulk is not None:
            await self.bulk.close()
        if self.transport is not None:
            await self.transport.close()
        if self.slots is not None:
            self.slots.close()
        if self.replicas is not None:
            self.replicas.close()
        if self.gate is not None:
            self.gate.close()
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

    app = FastAPI(title="ffplane statestore (ops, read-only)", version=version(), lifespan=lifespan, docs_url=None, redoc_url=None)
    offline_docs(app)

    @app.get("/v1/health")
    @app.get("/healthz")
    def health() -> dict[str, str]:
        """Liveness: the process serves HTTP."""
        return {"status": "ok"}

    @app.get("/readyz", responses={503: {"description": "not ready; the detail says why"}})
    def ready() -> JSONResponse:
        """Readiness: the root is prepared, the control socket is up and the coordinator answered
        a heartbeat in the last 10 s (a daemon it does not know cannot take part in the ring)."""
        hb = daemon.heartbeat
        why = None
        if daemon.control is None or not daemon.config.socket_path.exists():
            why = "the control socket is not up yet"
        elif hb is None or hb.answered_at is None:
            why = "no heartbeat answered by the coordinator yet"
        elif time.monotonic() - hb.answered_at > 10:
            why = f"the coordinator has not answered a heartbeat for {time.monotonic() - hb.answered_at:.0f} s"
        return JSONResponse({"status": "ready"} if why is None else {"detail": why}, status_code=200 if why is None else 503)

    @app.get("/v1/cache")
    def cache() -> dict[str, Any]:
        """What is cached per dp rank and step, bytes, hits/misses and prefetch lag."""
        assert daemon.cache is not None
        c = daemon.cache
        return {
            "root": str(daemon.config.root),
            "huge_pages": daemon.huge_pages,
            "window": daemon.config.window,
            "budget_bytes": daemon.config.budget_bytes,
            "bytes": c.cached_bytes(),
            "peak_bytes": c.peak_bytes,
            "fetched_bytes": c.bytes_fetched,
            "streams": [s.describe(daemon.config.window) for s in c.streams.values()],
        }

    @app.get("/v1/state")
    def state() -> dict[str, Any]:
        """Roles, committed versions (step, bytes, checksum, slot), unique and razored bytes,
        slot use, and the latency of each save's blocking part and of its commit."""
        assert daemon.state is not None
        slots, replicas = daemon.state.slots, daemon.state.replicas
        assert daemon.cache is not None
        held = {"cache": daemon.cache.cached_bytes(), "slots": slots.slot_bytes(), "replicas": replicas.held_bytes()}
        return {
            "slot_bytes": slots.slot_bytes(),
            "budget_bytes": daemon.config.budget_bytes,
            "memory": {**{f"{k}_bytes": v for k, v in held.items()}, "free_bytes": daemon.config.budget_bytes - sum(held.values())},
            "durable_dir": str(daemon.config.durable_dir) if daemon.config.durable_dir else None,
            "durable_every": daemon.config.durable_every,
            "durable_written": daemon.state.durable_written,
            "node_id": daemon.config.node_id,
            "coordinator": daemon.heartbeat.view if daemon.heartbeat else {},
            "roles": slots.describe(),
            "replicas": daemon.state.replicas.describe(),
            "replication": daemon.state.replicator.describe() if daemon.state.replicator else None,
            "pulled_bytes": daemon.state.pulled_bytes,
            "restores_behind": daemon.state.restores_behind,
            "warm": _warm(),
            "commit_parts": slots.commit_parts.describe(),
            "replica_parts": replicas.finish_parts.describe(),
            "transfer": {
                **(daemon.bulk.describe() if daemon.bulk else {"bulk_port": None, "bulk_pushes_received": 0, "bulk_refused": 0}),
                "received_bytes": replicas.received_bytes,
                "reused_files": replicas.reused_files,
            },
        }

    assert daemon.slots is not None and daemon.replicas is not None  # create_app follows prepare()
    app.include_router(
        peer_routes(
            daemon.token, daemon.slots, daemon.replicas, daemon.config.budget_bytes, lambda: daemon.bulk.port if daemon.bulk else None
        )
    )

    @app.get("/v1/gate")
    async def gate() -> dict[str, Any]:  # on the loop: the gate's hint maps are the loop's
        """The link gate: open or why closed, STATE bytes sent through it by priority, time paused."""
        assert daemon.gate is not None
        return daemon.gate.describe()

    registry = None

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"description": "Prometheus text exposition", "content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    def metrics() -> Response:
        nonlocal registry
        assert daemon.cache is not None and daemon.state is not None
        registry = registry or registry_for(daemon.cache, daemon.state.slots, daemon.gate, daemon.state, daemon.latencies, daemon.bulk)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _warm() -> dict[str, Any]:
    """This node's warm-start zygotes (``trainer_client.warm_start``, same user): a warm spare is
    one with a zygote ready."""
    return readiness(warm_dir())
