"""The node daemon's lifecycle, over one explicit state.

1. ``Daemon(config, token)`` opens the root (``statestore.root``) before the HTTP port is bound:
   it may refuse (``ShmError``), and then leaves the root as it found it.
2. ``bound(port)``: the port is bound; the address the heartbeat announces is known.
3. ``running()`` (the app's lifespan) starts, in the order they depend on each other, the parts
   that need the event loop or the address, and yields the running ``Node`` the routes serve;
   leaving it stops them, then closes the root.

Every part registers its close on a stack as it is built, so shutdown is startup in reverse, and a
failure midway through startup closes what was built (a daemon that never served also removes
again what it made in the root).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from prometheus_client import CollectorRegistry

from ffplane_contract.ring import parity_group
from statestore.config import DaemonConfig
from statestore.control import ControlServer
from statestore.heartbeat import Heartbeat
from statestore.latencies import Latencies
from statestore.metrics import registry_for
from statestore.ring import Replicator
from statestore.root import Root, open_root
from statestore.shard import CorruptCopies
from statestore.state_service import DurableConfig, StateService
from statestore.transport import BulkServer, BulkTransport, Transport

__all__ = ["Daemon", "Node"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Node:
    """A running daemon: its root and the parts started on the event loop. The routes serve it."""

    root: Root
    token: str | None
    address: str  # the ops/peer base URL other daemons reach this one at
    latencies: Latencies  # histograms for /metrics
    heartbeat: Heartbeat
    transport: Transport
    bulk: BulkServer | None  # the bulk port replica pushes arrive on; none with --bulk-port -1
    state: StateService
    control: ControlServer
    registry: CollectorRegistry  # /metrics


class Daemon:
    """Everything one node daemon owns, opened, started and closed in one order (module docstring)."""

    def __init__(self, config: DaemonConfig, token: str | None) -> None:
        config.validate()
        self.config = config
        self.token = token
        self._address = ""
        self._served = False  # set once started: from then on, closing keeps what the root holds
        self._stack = ExitStack()
        try:
            self.root = open_root(config, token, self._stack, lambda: self._served)
        except BaseException:
            self._stack.close()
            raise

    def bound(self, port: int) -> None:
        """The HTTP port is bound at ``port``: this daemon's address, which the heartbeat announces."""
        self._address = f"http://{self.config.advertised_url}:{port}"

    def close(self) -> None:
        """Close the root, its parts in the reverse order they were opened (safe to call twice)."""
        self._stack.close()

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Node]:
        """Start the daemon and yield it running; on leaving, stop everything, the root last."""
        if not self._address:
            raise RuntimeError("Daemon.running() needs the bound port first (Daemon.bound)")
        async with AsyncExitStack() as stack:
            stack.callback(self.close)
            node = await self._start(stack)
            self._served = True
            yield node

    async def _start(self, stack: AsyncExitStack) -> Node:
        """The parts on the event loop, each registering its close on ``stack`` as it is built."""
        cfg, root = self.config, self.root
        latencies = Latencies()
        heartbeat = Heartbeat(cfg, root.slots, root.replicas, self._address, self.token, root.servers)
        transport = BulkTransport(root.gate, self.token)
        await transport.start()
        stack.push_async_callback(transport.close)
        bulk = None
        if root.replicas.parity is not None:  # parity XORs each piece as it arrives: pushes come over HTTP
            parity_k = cfg.parity_k
            root.replicas.parity.group_of = lambda node: parity_group(sorted(heartbeat.view.get("ring", [])), node, parity_k)
        elif cfg.bulk_port >= 0:
            bulk = BulkServer(self.token, root.replicas)
            stack.push_async_callback(bulk.close)
            port = await bulk.start(cfg.host, cfg.bulk_port)
            log.info("bulk port ready", extra={"bulk_port": port})
        corrupt = CorruptCopies(cfg.node_id, root.slots, root.replicas)
        replicator = None
        if cfg.replicate:
            replicator = Replicator(
                cfg.node_id,
                root.slots,
                root.replicas,
                heartbeat,
                transport,
                cfg.replica_max_lag,
                cfg.replica_wait_s,
                corrupt.quarantine,
                latencies.replication.observe,
                cfg.parity_k,
            )
        state = StateService(
            cfg.root,
            root.slots,
            root.replicas,
            DurableConfig(cfg.durable_dir, cfg.durable_every),
            node_id=cfg.node_id,
            transport=transport,
            corrupt=corrupt,
            replicator=replicator,
            gate=root.gate,
            dataservers=root.servers,
            token=self.token,
            latencies=latencies,
        )
        stack.push_async_callback(state.close)
        await root.cache.start()  # its fetches serve the control socket's readers
        stack.push_async_callback(root.cache.close)
        control = ControlServer(root.cache, state, cfg.socket_path, heartbeat)
        stack.push_async_callback(control.close)  # (removes the socket file, whether or not it came up)
        await control.start()
        if replicator is not None:
            _run(stack, replicator.run(), "replicator")
        _run(stack, heartbeat.run(), "heartbeat")
        log.info("control socket ready", extra={"socket": str(cfg.socket_path)})
        registry = registry_for(root.cache, root.slots, root.gate, state, latencies, bulk)
        return Node(root, self.token, self._address, latencies, heartbeat, transport, bulk, state, control, registry)


def _run(stack: AsyncExitStack, work: Coroutine[Any, Any, None], name: str) -> None:
    """Run ``work`` as a task named ``name``, cancelled and awaited when ``stack`` closes. A task
    that fails says so when it does (it was meant to run until the daemon stops)."""
    task = asyncio.create_task(work, name=name)
    task.add_done_callback(_report)

    async def stop() -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):  # (an exception was reported as it ended)
            await task

    stack.push_async_callback(stop)


def _report(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("the daemon's %s task failed", task.get_name(), exc_info=exc)
