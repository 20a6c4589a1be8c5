"""torch.distributed.checkpoint (DCP) over the node daemon.

``dcp.save(state, storage_writer=DaemonWriter(job), checkpoint_id="step-100")`` (or
``dcp.async_save``) and ``dcp.load(state, storage_reader=DaemonReader(job))`` keep a DCP
trainer's checkpoint code and put its checkpoints in the memory tier: each rank's writes become
that rank's shard of the step (role ``dp<rank>-pp0-tp0`` of a ``dp=world`` layout), committed,
checksummed, replicated to the next node and copied to the durable tier exactly as a
``Checkpointer.save``; a step is restorable once every rank of the world that saved it has
committed, and a load never mixes two run segments.

DCP's planners decide what each rank writes (replicated state once, deduplicated) and reads
(resharding: a load into another world size or sharding reads the saved chunks that overlap its
own). So the load side needs every rank's chunk list: the coordinator's writer puts the whole
step's catalogue (each tensor's dtype, size and chunks, with the rank and key holding each) in
every rank's shard header — the header's static part, which goes to the daemon only when the
plan changes. A load reads one shard's header, plans, and pulls only the ranks' shards it reads.

No pickle crosses a process boundary: tensors are bytes in the shard; the non-tensor values DCP
would ``torch.save`` (step counters, optimizer param groups, scheduler state) are stored as
JSON, and a value that is not JSON-serialisable is refused naming its key.
"""

from __future__ import annotations

import io
import logging
import os
import re
from concurrent.futures import Future as _ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import StorageReader, StorageWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ffplane_contract import control as proto
from ffplane_contract import durable, files
from ffplane_contract.errors import CorruptError, FFPlaneError, NotFoundError, UnavailableError
from ffplane_contract.shard import lineage as lineage_of
from trainer_client._daemon_client import DaemonClient
from trainer_client._restore import ask_restorable, map_shard, reduce_min
from trainer_client.checkpointer import Checkpointer, next_lineage
from trainer_client.events import emit
from trainer_client.razor import Layout, role_name
from trainer_client.state_codec import LOADER_KIND, StateError, bind_position, decode, dtype_name, dtype_of, owned

__all__ = ["DaemonReader", "DaemonWriter", "Catalogue", "step_of"]

log = logging.getLogger(__name__)
SCHEME = "ffplane://"
CATALOGUE_VERSION = 1
_lineages: dict[str, int] = {}  # job → the run segment the last load in this process continues
Catalogue = dict[str, Any]  # the header's "dcp" field: see _catalogue
_MISSING = object()


def step_of(checkpoint_id: str | os.PathLike[str] | int, job: str | None = None) -> int:
    """The step a DCP ``checkpoint_id`` names: an int, ``ffplane://<job>/<step>``, or any path
    whose last part ends in the step (``outputs/checkpoint/step-100``, as torchtitan names them)."""
    if isinstance(checkpoint_id, int):
        return int(checkpoint_id)
    text = os.fspath(checkpoint_id).rstrip("/")
    if text.startswith(SCHEME):
        named, _, rest = text.removeprefix(SCHEME).partition("/")
        if job is not None and named != job:
            raise ValueError(f"checkpoint_id {text!r} names job {named!r}, this storage is for job {job!r}")
        text = rest
    found = re.search(r"(\d+)$", text.rsplit("/", 1)[-1])
    if not found:
        raise ValueError(
            f"checkpoint_id {checkpoint_id!r} names no step: pass the step (an int), 'ffplane://<job>/<step>', "
            "or a path ending in it such as 'checkpoint/step-100'"
        )
    return int(found.group(1))


def _key(index: MetadataIndex) -> str:
    return index.fqn if index.offset is None else f"{index.fqn}@{','.join(map(str, index.offset))}"


def _catalogue(plans: list[SavePlan]) -> Catalogue:
    """Every rank's writes of one save: each tensor's dtype, size and chunks (offsets, sizes,
    writing rank, key in its shard), each non-tensor value's rank and key, DCP's planner data."""
    tensors: dict[str, dict[str, Any]] = {}
    values: dict[str, list[Any]] = {}
    planner_data: dict[str, list[Any]] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                values[fqn] = [rank, _key(item.index)]
                continue
            td = item.tensor_data
            assert td is not None
            entry = tensors.setdefault(
                fqn,
                {
                    "dtype": dtype_name(td.properties.dtype),
                    "size": list(td.size),
                    "requires_grad": td.properties.requires_grad,
                    "chunks": [],
                },
            )
            entry["chunks"].append([list(td.chunk.offsets), list(td.chunk.sizes), rank, _key(item.index)])
        if isinstance(plan.planner_data, dict):
            planner_data.update({str(k): list(v) for k, v in plan.planner_data.items() if isinstance(v, (tuple, list))})
    return {"version": CATALOGUE_VERSION, "world": len(plans), "tensors": tensors, "values": values, "planner_data": planner_data}


def metadata_of(catalogue: Catalogue) -> tuple[Metadata, dict[MetadataIndex, tuple[str, str]]]:
    """DCP's ``Metadata`` for a catalogue, and where each item lives: (role, key in its shard)."""
    if catalogue.get("version") != CATALOGUE_VERSION:
        raise FFPlaneError(f"a DCP catalogue of version {catalogue.get('version')!r}; this ffplane reads version {CATALOGUE_VERSION}")
    md: dict[str, Any] = {}
    where: dict[MetadataIndex, tuple[str, str]] = {}
    for fqn, e in catalogue["tensors"].items():
        chunks = []
        for offsets, sizes, rank, key in e["chunks"]:
            chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            where[MetadataIndex(fqn, torch.Size(offsets))] = (role_name(rank, 0, 0), key)
        props = TensorProperties(dtype=dtype_of(e["dtype"]), requires_grad=bool(e["requires_grad"]))
        md[fqn] = TensorStorageMetadata(props, torch.Size(e["size"]), chunks)
    for fqn, (rank, key) in catalogue["values"].items():
        md[fqn] = BytesStorageMetadata()
        where[MetadataIndex(fqn)] = (role_name(rank, 0, 0), key)
    planner_data = {k: tuple(v) for k, v in catalogue.get("planner_data", {}).items()}
    return Metadata(md, planner_data=planner_data or None, storage_data=where), where


def _tight(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a compact copy where it views a much larger storage: the codec saves storages
    whole, and a chunk narrowed out of a big tensor must not drag the rest along."""
    t = t.detach()
    if t.untyped_storage().nbytes() > t.numel() * t.element_size() * 5 // 4 + 4096:
        return t.clone(memory_format=torch.contiguous_format)
    return t


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def narrow(t: torch.Tensor, offsets: torch.Size | list[int], sizes: torch.Size | list[int]) -> torch.Tensor:
    for dim, (off, n) in enumerate(zip(offsets, sizes)):
        if off != 0 or n != t.shape[dim]:
            t = t.narrow(dim, off, n)
    return t


class DaemonWriter(StorageWriter, AsyncStager):
    """A DCP ``StorageWriter`` that commits each rank's writes to its node daemon as the step's
    shard. The step comes from ``checkpoint_id`` (see ``step_of``). ``wait()`` blocks until the
    last save is committed; ``close()`` when done.

    Steady state: after one full ``dcp.save``, pass ``no_dist=True`` to the next ones. DCP then
    runs no collectives (its plans gathered, scattered and the results gathered cost more than
    the copy on small states); each rank commits its part of the last full save's plan, whose
    job-wide catalogue the load side reads. Refused, naming the entry, if the state no longer
    matches that plan: make that save a full one.

    It is also ``dcp.async_save``'s stager: the blocking part of an async save is one copy of the
    state into staging tensors allocated on the first save and reused (DCP's default stager
    allocates them afresh every save). So wait for an async save's future before the next one,
    as DCP trainers do: the next save's staging overwrites the previous one's.
    """

    _synchronize_after_execute = False

    def __init__(
        self,
        job: str,
        *,
        socket_path: str | os.PathLike[str] | None = None,
        durable_dir: str | os.PathLike[str] | None = None,
        timeout_s: float = 120.0,
        copy_threads: int | None = None,
    ) -> None:
        self.job = job
        self.socket_path, self.durable_dir = socket_path, durable_dir
        self.timeout_s, self.copy_threads = timeout_s, copy_threads
        self.step: int | None = None
        self._ckpt: Checkpointer | None = None
        self._staging: dict[str, Any] | None = None
        self._job_plan: tuple[int, int, Catalogue] | None = None  # the last full save's: rank, world, catalogue

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.step = step_of(checkpoint_id, self.job)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` copied into this writer's staging tensors (``dcp.async_save``'s blocking part)."""
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        if self._staging is not None:
            try:
                return _copy_state_dict(state_dict, self._staging)
            except (KeyError, RuntimeError, ValueError, TypeError, AssertionError):
                self._staging = None  # the state's structure or shapes changed: stage anew
        self._staging = _create_cpu_state_dict(state_dict)
        return _copy_state_dict(state_dict, self._staging)

    def synchronize_staging(self) -> None:
        """The copies in ``stage`` are synchronous: nothing to wait for."""

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.step is None:
            raise ValueError("DaemonWriter needs the step: pass checkpoint_id= to dcp.save (e.g. 'step-100' or 100)")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if len(plans) == 1 and _world() > 1:  # dcp.save(..., no_dist=True) in a multi-rank job
            return [self._steady_plan(plans[0])]
        catalogue = _catalogue(plans)
        return [replace(p, storage_data={"rank": i, "world": len(plans), "catalogue": catalogue}) for i, p in enumerate(plans)]

    def _steady_plan(self, plan: SavePlan) -> SavePlan:
        """This rank's part of the last full save's plan, for a save without DCP's collectives:
        the same items (DCP's deduplication of replicated values, taken from that plan), the
        same job-wide catalogue in the header. Refused if there was no full save, or the state
        has changed since (an entry added or gone, a chunk of another size)."""
        if self._job_plan is None:
            raise FFPlaneError(
                f"dcp.save(..., no_dist=True) of step {self.step} in a {_world()}-rank job needs the job's plan: make the first "
                "save a full dcp.save (without no_dist), then no_dist=True reuses its plan"
            )
        rank, world, catalogue = self._job_plan
        sizes = {key: sizes for e in catalogue["tensors"].values() for _, sizes, _, key in e["chunks"]}
        owner = {key: r for e in catalogue["tensors"].values() for _, _, r, key in e["chunks"]}
        owner |= {key: r for r, key in catalogue["values"].values()}
        items, changed = [], []
        for item in plan.items:
            key = _key(item.index)
            if key not in owner:
                changed.append(f"{key} (new)")
            elif item.type != WriteItemType.BYTE_IO and item.tensor_data is not None and list(item.tensor_data.chunk.sizes) != sizes[key]:
                changed.append(f"{key} (a chunk of {list(item.tensor_data.chunk.sizes)}, saved {sizes[key]})")
            elif owner[key] == rank:
                items.append(item)
        missing = sorted({k for k, r in owner.items() if r == rank} - {_key(i.index) for i in items})
        if changed or missing:
            raise FFPlaneError(
                f"dcp.save(..., no_dist=True) of step {self.step}: the state differs from the last full save's plan "
                f"({', '.join(changed + [f'{k} (gone)' for k in missing])[:300]}); make this save a full dcp.save"
            )
        return replace(plan, items=items, storage_data={"rank": rank, "world": world, "catalogue": catalogue})

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assert self.step is not None
        data = plan.storage_data
        rank, world, catalogue = int(data["rank"]), int(data["world"]), data["catalogue"]
        self._job_plan = (rank, world, catalogue)  # what a no_dist save of the same state reuses
        ckpt = self._checkpointer(rank, world)
        items: dict[str, Any] = {}
        results = []
        for item in plan.items:
            key = _key(item.index)
            if item.type == WriteItemType.BYTE_IO:
                items[key] = _value_of(planner, item)
                size = 0
            else:
                items[key] = t = _tight(planner.resolve_data(item))  # type: ignore[arg-type]
                size = t.numel() * t.element_size()
            results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=[role_name(rank, 0, 0), key]))
        _bind_loaders(items, self.step)
        ckpt.lineage = _lineages.get(self.job, ckpt.lineage)
        try:
            ckpt.save(self.step, {"items": items}, header={"dcp": catalogue})
        except StateError as exc:
            raise StateError(f"DCP save of step {self.step}: {exc}") from exc
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _checkpointer(self, rank: int, world: int) -> Checkpointer:
        layout = Layout(dp=world, dp_rank=rank)
        if self._ckpt is not None and self._ckpt.layout != layout:
            self._ckpt.close()  # the world changed (elastic): a new layout, new roles
            self._ckpt = None
        if self._ckpt is None:
            self._ckpt = Checkpointer(
                self.job,
                layout,
                private_keys=("items",),  # DCP already writes replicated state once, on one rank
                socket_path=self.socket_path,
                durable_dir=self.durable_dir,
                timeout_s=self.timeout_s,
                copy_threads=self.copy_threads,
            )
        return self._ckpt

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing to write: each rank committed its own shard, and the step is whole (restorable)
        once every rank's commit is in."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return os.fspath(checkpoint_id).startswith(SCHEME)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"{SCHEME}{self.job}/{self.step}")

    def wait(self) -> None:
        """Block until this rank's last save is committed (raises if its commit failed)."""
        if self._ckpt is not None:
            self._ckpt.wait()

    def close(self) -> None:
        if self._ckpt is not None:
            self._ckpt.close()
            self._ckpt = None
        self._staging = None


def _bind_loaders(items: dict[str, Any], step: int) -> None:
    """DCP flattens a DataLoader's position into ``<prefix>.kind`` and ``<prefix>.next_step``
    values: bind it to the saved step as ``Checkpointer.save`` does (``bind_position``)."""
    for key, value in list(items.items()):
        if key.endswith("kind") and value == LOADER_KIND:
            prefix = key[: -len("kind")]
            if prefix + "next_step" in items:
                bound = bind_position({"next_step": items[prefix + "next_step"]}, step, (prefix.rstrip("."),))
                items[prefix + "next_step"] = bound["next_step"]


def _value_of(planner: SavePlanner, item: WriteItem) -> Any:
    """A non-tensor value as the object itself (stored as JSON), not as DCP's torch.save bytes."""
    lookup = getattr(planner, "lookup_object", None)
    if lookup is None:
        raise StateError(
            f"DCP item {item.index.fqn!r} is a non-tensor value and the planner {type(planner).__name__} does not expose "
            "lookup_object(): ffplane stores such values as JSON, not pickles; use a DefaultSavePlanner subclass"
        )
    return lookup(item.index)


_READ_ATTEMPTS = 3  # the local slot, the replica, and one more place a rebuilt ring may hold


class DaemonReader(StorageReader):
    """A DCP ``StorageReader`` over the node daemon (and, with ``durable_dir`` and no daemon
    answering, over the durable tier). ``checkpoint_id`` picks the step; without one, the newest
    step the whole job can restore (the ranks agree on it). ``process_group``: the group the
    ranks agree over (default: the default group, when there is one)."""

    def __init__(
        self,
        job: str,
        *,
        socket_path: str | os.PathLike[str] | None = None,
        durable_dir: str | os.PathLike[str] | None = None,
        timeout_s: float = 120.0,
        process_group: Any = None,
    ) -> None:
        self.job = job
        self.socket_path = files.socket_path(socket_path)
        self.durable_dir = Path(durable_dir) if durable_dir else None
        self.timeout_s = timeout_s
        self.process_group = process_group
        self.step: int | None = None
        self.source = ""
        self._client: DaemonClient | None = None
        self._where: dict[MetadataIndex, tuple[str, str]] = {}
        self._use_daemon = True

    # --- which step ----------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.step = None if checkpoint_id is None else step_of(checkpoint_id, self.job)

    def find(self) -> int | None:
        """The newest step every rank can load (a collective when there is a process group),
        or None when the job has none. ``dcp.load`` calls it when no ``checkpoint_id`` is given."""
        error: FFPlaneError | None = None
        mine = -1
        try:
            reply = self._restorable([], self.step)
            mine = -1 if reply.step is None else int(reply.step)
        except FFPlaneError as exc:
            error = exc
        ok, low, high = reduce_min(self._group(), [0 if error else 1, mine, -mine])
        if not ok:
            raise error or FFPlaneError(f"another rank could not look up job {self.job!r}'s checkpoints; see its log")
        if -high < 0:
            return None
        if low < 0:
            raise NotFoundError(
                f"some ranks found no checkpoint of job {self.job!r} while others found step {-high}; is every node's daemon running?"
            )
        return low

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        emit("restoring")
        step = self.step if self.step is not None else self.find()
        if step is None:
            raise NotFoundError(f"job {self.job!r} has no checkpoint to load (start fresh, or check the daemons and durable_dir)")
        self.step = step
        reply = self._restorable([], step)
        if reply.step != step or not reply.roles:
            raise NotFoundError(f"step {step} of job {self.job!r} is not restorable here: {reply.message or 'not every rank committed it'}")
        roles = list(reply.roles)
        rank = self._rank()
        mine = role_name(rank, 0, 0)
        source = mine if mine in roles else roles[rank % len(roles)]  # spread the header reads
        header = self._shards([source], step)[source]["header"]
        catalogue = header.get("dcp")
        if catalogue is None:
            raise FFPlaneError(
                f"step {step} of job {self.job!r} was saved by a Checkpointer, not through DCP; restore it with Checkpointer.restore"
            )
        metadata, self._where = metadata_of(catalogue)
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not self._where:
            raise FFPlaneError("DaemonReader.read_metadata() was not called before set_up_storage_reader()")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    # --- reading -------------------------------------------------------------------------
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self.step is not None
        # A copy that fails its checksum is dropped by the daemon, which then serves another
        # (the replica on the next node): read the plan again from it, as Checkpointer.restore
        # does. The items already copied from the bad copy are all overwritten by the re-read.
        for _ in range(_READ_ATTEMPTS):
            shards = self._read_once(plan, planner)
            if shards is not None:
                break
        else:
            raise CorruptError(
                f"every copy of step {self.step} of job {self.job!r} this node could reach failed its checksum "
                f"({_READ_ATTEMPTS} tried); load an older step (checkpoint_id=...)"
            )
        lineages = {lineage_of(sh["header"]) for sh in shards.values()}
        _lineages[self.job] = next_lineage(min(lineages) if lineages else 0, self.step)
        self.source = ",".join(sorted({str(sh.get("kind", "")) for sh in shards.values()}))
        emit("restored", step=self.step, source=self.source)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_once(self, plan: LoadPlan, planner: LoadPlanner) -> dict[str, Any] | None:
        """Copy the plan's items from the shards the daemon serves now; None if a copy failed
        its checksum (the daemon has dropped it)."""
        assert self.step is not None
        needed = sorted({self._where[item.storage_index][0] for item in plan.items})
        shards = self._shards(needed, self.step) if needed else {}
        if len({lineage_of(sh["header"]) for sh in shards.values()}) > 1:
            raise CorruptError(
                f"step {self.step} of job {self.job!r} mixes shards of two run segments (a rank committed it before the job "
                "rewound); load an older step (checkpoint_id=...)"
            )
        verify = self._verify_async(self.step, [r for r, sh in shards.items() if sh.get("kind") not in (None, "durable")])
        items = {role: shard_items(sh) for role, sh in shards.items()}
        for item in plan.items:
            role, key = self._where[item.storage_index]
            value = items[role].get(key, _MISSING)
            if value is _MISSING:
                raise CorruptError(f"{role}'s shard of step {self.step} lacks {key!r}, which its catalogue lists")
            self._read_item(item, value, planner)
        if verify is not None and not verify.result(timeout=self.timeout_s).intact:
            return None
        return shards

    def _read_item(self, item: ReadItem, value: Any, planner: LoadPlanner) -> None:
        if item.type == LoadItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(owned(value), buf)  # in this process only: DCP's planner loads values from torch.save bytes
            buf.seek(0)
            planner.load_bytes(item, buf)
            return
        src = narrow(value, item.storage_offsets, item.lengths)
        dst = planner.resolve_tensor(item).detach()
        if dst.shape != src.shape:
            raise CorruptError(f"{item.storage_index.fqn}: the plan reads {tuple(dst.shape)} from a saved chunk part of {tuple(src.shape)}")
        with torch.no_grad():
            dst.copy_(src)
        planner.commit_tensor(item, dst)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return os.fspath(checkpoint_id).startswith(SCHEME)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # --- the daemon, or the durable tier -------------------------------------------------
    def _group(self) -> Any:
        if self.process_group is not None:
            return self.process_group
        import torch.distributed as dist

        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None

    def _rank(self) -> int:
        import torch.distributed as dist

        group = self._group()
        return dist.get_rank(group) if group is not None else 0

    def _call(self, req: proto.Request) -> Any:
        if self._client is None:
            self._client = DaemonClient(self.socket_path, self.timeout_s)
        try:
            return self._client.call(req)
        except FFPlaneError:
            self.close()
            raise

    def _restorable(self, roles: list[str], step: int | None) -> proto.RestorableReply:
        if self._use_daemon:
            try:
                return ask_restorable(self._call, proto.Restorable(self.job, False, None, roles, step), self.timeout_s)
            except UnavailableError:
                raise
            except FFPlaneError as exc:
                if self.durable_dir is None:
                    raise
                log.warning("no daemon answered (%s): reading the durable tier %s", exc, self.durable_dir)
                self._use_daemon = False
        assert self.durable_dir is not None
        found, shards = durable.restorable(self.durable_dir, self.job, None if step is None else step + 1)
        if step is not None and found != step:
            return proto.RestorableReply(None, None, {}, f"the durable tier {self.durable_dir} has no whole step {step}")
        return proto.RestorableReply(
            found, "durable", {r: {**s, "kind": "durable"} for r, s in shards.items() if r in roles}, None, False, sorted(shards)
        )

    def whole_step(self, step: int) -> dict[str, dict[str, Any]]:
        """Every rank's shard of ``step`` (``ffplane export`` reads them all)."""
        reply = self._restorable([], step)
        if reply.step != step or not reply.roles:
            raise NotFoundError(f"step {step} of job {self.job!r} is not whole anywhere: {reply.message or 'not every rank committed it'}")
        return self._shards(list(reply.roles), step)

    def _shards(self, roles: list[str], step: int) -> dict[str, dict[str, Any]]:
        reply = self._restorable(roles, step)
        missing = sorted(set(roles) - set(reply.shards))
        if reply.step != step or missing:
            raise NotFoundError(f"step {step} of job {self.job!r}: no intact copy of {missing or roles} ({reply.message or 'gone'})")
        return dict(reply.shards)

    def _verify_async(self, step: int, roles: list[str]) -> _ThreadFuture[Any] | None:
        if not roles or not self._use_daemon:
            return None  # durable copies were verified when read
        pool = ThreadPoolExecutor(1)
        try:
            return pool.submit(self._call, proto.Verify(self.job, step, roles))
        finally:
            pool.shutdown(wait=False)


def shard_items(shard: dict[str, Any]) -> dict[str, Any]:
    """A DCP shard's items (key → tensor viewing the mapped shard, or JSON value)."""
    header = shard["header"]
    mapped = map_shard(shard)
    storages = []
    for entry in header["storages"]:
        if entry["stream"] != "private":
            raise CorruptError(f"a DCP shard with a razored storage ({shard.get('path')}): not written by DaemonWriter")
        storages.append(mapped[entry["offset"] : entry["offset"] + entry["nbytes"]])
    items: dict[str, Any] = decode(header, storages)["items"]
    return items
