"""The daemon's root opened: what the tmpfs holds for it, reattached and fitted to its budget.

Opening the root is the part of a start that may refuse (another daemon holds the root, the tmpfs
cannot hold the budget, the checkpoints there need a bigger one), and it runs before the HTTP port
is bound. Every part registers its close on the ``ExitStack`` it is given, as it is built; a start
that never got to serve closes them and leaves the root as it found it (no lock file, no index or
hints folder it created, no root folder it created).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ffplane_contract.files import HINTS_DIR
from statestore import shm
from statestore.budget import CACHE_HOLDER, REPLICAS_HOLDER, SLOTS_HOLDER, Budget
from statestore.config import DaemonConfig
from statestore.data_cache import DataCache
from statestore.dataservers import DataServers
from statestore.index import Index
from statestore.link_gate import LinkGate
from statestore.parity import ParityStore
from statestore.rebuild import QUARANTINE, rebuild, set_aside
from statestore.replicas import ReplicaStore
from statestore.slots import SlotStore

__all__ = ["Root", "open_root"]

log = logging.getLogger(__name__)
_MADE_HERE = ("_index", HINTS_DIR)  # what a start that never served removes again, if it made it


@dataclass(frozen=True)
class Root:
    """What the root holds, ready before the port is bound. The data cache, the slots and the
    replicas share ``budget``."""

    config: DaemonConfig
    index: Index
    gate: LinkGate
    servers: DataServers
    budget: Budget
    cache: DataCache
    slots: SlotStore
    replicas: ReplicaStore
    huge_pages: str  # the root tmpfs's huge= option


def open_root(config: DaemonConfig, token: str | None, stack: ExitStack, served: Callable[[], bool]) -> Root:
    """Lock the root, reclaim stale files, reattach, fit the budget and check the tmpfs has room.
    Each part's close goes on ``stack``; ``served()`` says, when the stack closes, whether the
    daemon served (else what this start made in the root is removed again)."""
    root = config.root
    created_root, had = not root.exists(), {d for d in _MADE_HERE if (root / d).exists()}
    lock = shm.acquire_root(root)
    stack.callback(_release, root, lock, created_root, had, served)
    stale = shm.reclaim_stale(root)
    index = _open_index(root)
    stack.callback(index.close)
    gate = LinkGate(config.gate, root)
    stack.callback(gate.close)
    servers = DataServers(config.dataserver)
    budget = Budget(config.budget_bytes)
    cache = DataCache(config, index, token, gate, servers, budget)  # nothing to close before it starts
    slots = SlotStore(root, index, budget, config.versions)
    stack.callback(slots.close)
    parity = None
    if config.parity_k:
        # its group rule is the ring view's, once the heartbeat has one (statestore.daemon)
        parity = ParityStore(root, index, config.parity_k, config.versions, group_of=lambda node: (node,), free=budget.free)
        stack.callback(parity.close)
    replicas = ReplicaStore(root, index, budget, config.versions, parity)
    stack.callback(replicas.close)
    kept, dropped = cache.reattach()
    versions, held = slots.reattach(), replicas.reattach() + (parity.reattach() if parity is not None else 0)
    _fit_budget(config, budget, cache)
    shm.check_room(root, budget.total, already_ours=budget.used())
    huge_pages = shm.huge_pages(root)
    if huge_pages not in ("within_size", "always"):
        log.info(
            "the root's tmpfs has 4 KiB pages: readers map cached steps at about half the speed they "
            "would on a tmpfs mounted with huge=within_size (see docs/deployment.md)",
            extra={"root": str(root), "huge": huge_pages},
        )
    log.info(
        "root ready",
        extra={
            "root": str(root),
            "huge_pages": huge_pages,
            "reattached_steps": kept,
            "reattached_versions": versions,
            "reattached_replicas": held,
            "dropped": dropped,
            "stale_tmp": stale,
        },
    )
    return Root(config, index, gate, servers, budget, cache, slots, replicas, huge_pages)


def _release(root: Path, lock: IO[bytes], created_root: bool, had: set[str], served: Callable[[], bool]) -> None:
    """Let go of the root; a start that never served also removes what it made there."""
    if not served():
        for made in set(_MADE_HERE) - had:
            shutil.rmtree(root / made, ignore_errors=True)
        (root / "daemon.lock").unlink(missing_ok=True)
    lock.close()
    if created_root and not served():
        with contextlib.suppress(OSError):
            root.rmdir()  # only if this start left nothing else in it


def _open_index(root: Path) -> Index:
    """The root's index; a damaged or missing one is rebuilt from the slot and replica files."""
    index, problem = Index.open_checked(root)
    if index is not None:
        return index
    stamp = time.strftime("%Y%m%dT%H%M%S")
    old = set_aside(root, root / "_index", stamp) if (root / "_index").exists() else None
    index = Index(root)
    try:
        rebuilt = rebuild(root, index, stamp)
    except BaseException:
        index.close()
        raise
    log.warning(
        f"the index was {problem}: rebuilt it from the slot and replica files; what could not be verified is in "
        f"{root / QUARANTINE / stamp} (delete it once looked at: it takes room in the tmpfs)",
        extra={"versions": rebuilt.versions, "replicas": rebuilt.replicas, "quarantined": rebuilt.quarantined, "old_index": old},
    )
    return index


def _fit_budget(config: DaemonConfig, budget: Budget, cache: DataCache) -> None:
    """A root reattached under a smaller ``--budget-mb`` than it holds: cached data steps go
    (they are fetched again when read), said in one line; checkpoint slots and replicas are
    never dropped to fit, so a budget below them is refused, naming what they hold."""
    held = budget.held()
    cached, state = held[CACHE_HOLDER], held[SLOTS_HOLDER] + held[REPLICAS_HOLDER]
    if cached + state <= budget.total:
        return
    mib = 1 << 20
    if state > budget.total:
        raise shm.ShmError(
            f"{config.root} holds {held[SLOTS_HOLDER] / mib:.0f} MiB of checkpoint slots and {held[REPLICAS_HOLDER] / mib:.0f} MiB of "
            f"replicas, more than --budget-mb {budget.total // mib}: start with --budget-mb {-(-state // mib)} or more "
            "(the checkpoints are kept), or empty the root to start without them"
        )
    dropped = cache.shrink(budget.total - state)
    log.warning(
        f"the root held {(cached + state) / mib:.0f} MiB, more than --budget-mb {budget.total // mib}: dropped "
        f"{dropped / mib:.0f} MiB of cached data steps (fetched again when read); checkpoint slots and replicas kept",
        extra={"root": str(config.root), "budget_bytes": budget.total, "dropped_bytes": dropped, "state_bytes": state},
    )
