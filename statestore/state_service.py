"""The state half of the daemon: slots, commits, the durable tier and the restorable step."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from statestore import durable
from statestore.slots import SlotStore, Version

log = logging.getLogger(__name__)


@dataclass
class DurableConfig:
    directory: Path | None = None
    every: int = 0  # steps; 0 = off

    def due(self, step: int) -> bool:
        return self.directory is not None and self.every > 0 and step % self.every == 0


class StateService:
    def __init__(self, root: Path, slots: SlotStore, durable_cfg: DurableConfig) -> None:
        self.root = root
        self.slots = slots
        self.durable = durable_cfg
        self._pinned: dict[str, int] = {}  # slot path → durable writes in progress
        self._tasks: set[asyncio.Task[None]] = set()
        self.durable_written = 0

    def begin(self, job: str, role: str, step: int) -> str:
        # a slot still being copied to the durable tier must not be overwritten
        return self.slots.begin(job, role, step, exclude=set(self._pinned))

    async def commit(self, job: str, role: str, step: int, slot: str, nbytes: int, header: dict[str, Any], save_block_s: float) -> Version:
        version = await self.slots.commit(job, role, step, slot, nbytes, header, save_block_s)
        if self.durable.due(step):
            self._pinned[slot] = self._pinned.get(slot, 0) + 1
            task = asyncio.create_task(self._write_durable(job, role, version), name=f"durable {job}/{role}/{step}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return version

    async def _write_durable(self, job: str, role: str, v: Version) -> None:
        assert self.durable.directory is not None
        try:
            data = memoryview(self.slots.mapped(v.path))[: v.nbytes]
            await asyncio.to_thread(durable.write_shard, self.durable.directory, job, role, v.step, data, v.checksum, v.header)
            self.durable_written += 1
        except Exception:
            log.exception("durable write failed", extra={"job": job, "role": role, "step": v.step})
        finally:
            self._pinned[v.path] -= 1
            if not self._pinned[v.path]:
                del self._pinned[v.path]

    async def verify(self, job: str, step: int) -> bool:
        versions = self.slots.versions_at(job, step)
        return bool(versions) and await self.slots.verify_step(versions)

    async def restorable(self, job: str, verify: bool = True, below: int | None = None) -> dict[str, Any]:
        step, versions = await self.slots.restorable(job, verify, below)
        if step is not None:
            shards = {
                role: {"path": str(self.root / v.path), "offset": 0, "nbytes": v.nbytes, "checksum": v.checksum, "header": v.header}
                for role, v in versions.items()
            }
            return {"step": step, "source": "memory", "shards": shards}
        if self.durable.directory is not None:
            roles = {r for (j, r) in self.slots.roles if j == job}
            dstep, dshards = await asyncio.to_thread(durable.restorable, self.durable.directory, job, roles)
            if dstep is not None:
                log.warning("no intact copy in memory: restoring from the durable tier", extra={"job": job, "step": dstep})
                return {"step": dstep, "source": "durable", "shards": dshards}
        return {"step": None, "source": None, "shards": {}}

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
