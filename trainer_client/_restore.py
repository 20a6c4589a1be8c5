"""The restore side of a Checkpointer: which step every rank loads, and loading it.

Every rank asks its daemon for the newest restorable step; the ranks take the minimum (a
collective), load that step, and agree on the outcome: intact, a copy failed its checksum (try
the step's other copies), or older (some role has no intact copy, or the shards mix two run
segments). Every rank makes the same collective calls whatever happens locally: a rank that
fails says so through the reduction, and then every rank raises — no rank is left waiting in an
all_reduce the others never join.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ffplane_contract import control as proto
from ffplane_contract import durable
from ffplane_contract.errors import CorruptError, FFPlaneError, NotFoundError, UnavailableError
from ffplane_contract.shard import lineage as lineage_of
from ffplane_runtime.pagemap import populate_read
from trainer_client._commit import CommitPipeline
from trainer_client.pinned import Registration, cuda_present
from trainer_client.razor import Layout
from trainer_client.state_codec import decode

log = logging.getLogger(__name__)
# A rank's outcome of loading the agreed step; the ranks act on the minimum.
_FAILED, _OLDER, _ANOTHER_COPY, _INTACT = -1, 0, 1, 2
_warned_alone: list[bool] = []  # the single-process warning, once per process
_MAX_COPIES_PER_STEP = 8  # each try drops a corrupt copy, so this only bounds a misbehaving daemon

Found = tuple[int, str, dict[str, Any]]  # step, source ("memory" | "durable"), shards by role


class LayoutError(FFPlaneError):
    """The restorable step was saved by a job of another parallel shape."""


@dataclass
class Restored:
    step: int
    state: Any
    source: str  # "memory" or "durable"


class RestoreAgreement:
    def __init__(
        self,
        pipeline: CommitPipeline,
        job: str,
        layout: Layout,
        durable_dir: Path | None,
        timeout_s: float,
        copy: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], None],
    ) -> None:
        self.pipeline = pipeline
        self.job, self.layout, self.role = job, layout, layout.role
        self.durable_dir = durable_dir
        self.timeout_s = timeout_s
        self.copy = copy
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"ffplane-verify-{job}-{self.role}")

    def run(self, into: Any, view: bool, group: Any, mesh: Any = None) -> tuple[Restored | None, int]:
        """The agreed step's state (None on a fresh job) and the lineage it continues."""
        if group is None and len(self.layout.all_roles()) > 1 and not _warned_alone:
            _warned_alone.append(True)
            log.warning(
                "restoring role %s of a %d-role layout in a process outside any torch.distributed group: the ranks cannot agree on "
                "a step. Launch the job with torchrun (or call init_process_group before restore()), or use Layout() for one process",
                self.role,
                len(self.layout.all_roles()),
                extra={"job": self.job},
            )
        below: int | None = None
        retries = 0
        while True:
            error: BaseException | None = None
            found = None
            try:
                found = self._restorable(below)
            except FFPlaneError as exc:
                error = exc
            mine = -1 if found is None else found[0]
            ok, low, high = reduce_min(group, [0 if error else 1, mine, -mine])
            if not ok:
                raise error or FFPlaneError(f"another rank could not look up its checkpoint of job {self.job!r}; see that rank's log")
            if -high < 0:  # no rank found anything
                if below is not None:  # there were versions, and every one failed its checksum
                    raise CorruptError(
                        f"no intact checkpoint of job {self.job!r} below step {below} for every role; all copies failed their checksums"
                    )
                return None, 0
            if low < 0:
                raise NotFoundError(
                    f"some ranks of job {self.job!r} found no checkpoint while others found step {-high}; refusing to start "
                    "fresh beside restored ranks (is every node's daemon running and reachable?)"
                )
            step = low  # the ranks' minimum; every rank loads exactly this step
            status, restored, source, lineage = _INTACT, None, "", 0
            try:
                if found is None or found[0] != step:
                    found = self._restorable(below, step=step)
                    if found is None or found[0] != step:
                        raise NotFoundError(f"the ranks agreed on step {step} but this daemon cannot provide it for role {self.role}")
                _, source, shards = found
                # the daemon checks the checksums of the in-memory shards we use while we copy them
                in_memory = [] if source == "durable" else sorted(r for r, sh in shards.items() if sh.get("kind") != "durable")
                intact = self._pool.submit(self.pipeline.call, proto.Verify(self.job, step, in_memory)) if in_memory else None
                lineages = {lineage_of(sh["header"]) for sh in shards.values()}
                lineage = min(lineages)
                restored = self._load(step, source, shards, into, view, mesh)
                if intact is not None and not intact.result(timeout=self.timeout_s).intact:
                    status = _ANOTHER_COPY  # the daemon dropped the corrupt copy; the step may have others
                if len(lineages) > 1:
                    status = _OLDER
            except CorruptError as exc:  # no intact copy of some role at this step
                log.warning("%s", exc, extra={"job": self.job, "role": self.role})
                status, lineage = _OLDER, 0
            except FFPlaneError as exc:
                error, status, lineage = exc, _FAILED, 0
            agreed_status, low, high = reduce_min(group, [status, lineage, -lineage])
            if agreed_status == _FAILED:
                raise error or FFPlaneError(f"another rank could not restore step {step} of job {self.job!r}; see its log")
            if agreed_status == _INTACT and low == -high and restored is not None:
                return restored, low
            if agreed_status == _ANOTHER_COPY and retries < _MAX_COPIES_PER_STEP:
                retries += 1
                log.warning(
                    "a copy of step %d failed its checksum and was dropped; trying its other copies",
                    step,
                    extra={"job": self.job, "role": self.role},
                )
                below = step + 1
                continue
            log.warning(
                "step %d has no intact copy of some role, or mixes shards of a run the job rewound from; restoring an older step",
                step,
                extra={"job": self.job, "role": self.role},
            )
            below, retries = step, 0

    def _load(self, step: int, source: str, shards: dict[str, Any], into: Any, view: bool, mesh: Any) -> Restored:
        me = shards.get(self.role)
        any_shard: dict[str, Any] = me or next(iter(shards.values()), {})
        saved: dict[str, Any] = dict(any_shard.get("header", {}).get("layout") or {})
        shape = {k: getattr(self.layout, k) for k in ("dp", "pp", "tp")}
        if saved and {k: saved.get(k, 1) for k in shape} != shape:
            raise LayoutError(
                f"step {step} of job {self.job!r} was saved by a job of shape { ({k: saved.get(k, 1) for k in shape}) }, this one is "
                f"{shape}: a Checkpointer restores into the shape it saved with; to change it, save and load through DCP "
                "(trainer_client.dcp), which reshards"
            )
        if me is None:
            raise NotFoundError(f"step {step} has no shard for role {self.role}; roles present: {sorted(shards)}")
        owned = into is None and not view  # the caller gets tensors that no slot reuse can touch
        # views stay on the private mapping, unpinned: pinning it would copy every page (map_shard)
        to_device = cuda_present() and not view and (_holds_cuda(into) or (owned and _saved_on_device(me["header"])))
        pins: list[Registration] | None = [] if to_device else None
        header, storages = role_storages(self.role, shards, self.layout.dp_peers(), step, owned, pins)
        try:
            if owned and pins is not None:
                storages = _onto_devices(header, storages, self.copy)
            state = decode(header, storages, into, copy=self.copy, mesh=mesh)
        finally:
            for pin in pins or []:
                pin.release()  # every copy out of them has completed
        return Restored(step, state, source)

    def _restorable(self, below: int | None, step: int | None = None) -> Found | None:
        try:
            reply = self._ask_restorable(below, step)
        except UnavailableError:
            raise
        except FFPlaneError as exc:
            if self.durable_dir is None:
                raise
            log.warning("no daemon answered (%s): restoring from the durable tier %s", exc, self.durable_dir)
            return self._durable()
        if reply.message:
            log.warning("%s", reply.message, extra={"job": self.job, "role": self.role})
        if reply.step is None:
            if reply.corrupt:
                raise CorruptError(f"job {self.job!r}: {reply.message}")
            found = self._durable() if self.durable_dir is not None else None  # our own copy, if any
            if found is None and reply.message and below is None:
                # the job has state, just no consistent step of it: starting fresh would silently
                # throw the run away
                raise NotFoundError(f"job {self.job!r} cannot be restored: {reply.message}; pass durable_dir= to use a durable copy")
            return found
        return int(reply.step), str(reply.source), dict(reply.shards)

    def _ask_restorable(self, below: int | None, step: int | None) -> proto.RestorableReply:
        roles = sorted({self.role, *self.layout.dp_peers()})
        return ask_restorable(self.pipeline.call, proto.Restorable(self.job, False, below, roles, step), self.timeout_s, self.role)

    def _durable(self) -> Found | None:
        assert self.durable_dir is not None
        step, shards = durable.restorable(self.durable_dir, self.job)
        return None if step is None else (step, "durable", shards)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def ask_restorable(call: Callable[[proto.Request], Any], req: proto.Restorable, timeout_s: float, role: str = "") -> proto.RestorableReply:
    """The daemon's answer to ``req``, asked again while a node holding a needed shard does not
    answer (it may be dying: the coordinator declares it dead within two seconds, and then
    another copy is chosen), for at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            reply: proto.RestorableReply = call(req)
            return reply
        except UnavailableError as exc:
            if time.monotonic() > deadline:
                raise
            log.warning("%s", exc, extra={"job": req.job, "role": role})
            time.sleep(0.5)


def reduce_min(group: Any, values: list[int]) -> list[int]:
    """Element-wise minimum over the ranks (the values themselves without a process group)."""
    if group is None:
        return values
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.int64)
    if dist.get_backend(group) == "nccl":  # NCCL reduces device tensors only
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [int(v) for v in t.tolist()]


def map_file(path: str | Path, shared_read_only: bool = False) -> torch.Tensor:
    """The whole file as a uint8 tensor over a mapping, faulted in: private (copy-on-write, so a
    caller's in-place change cannot reach the daemon's file) or shared and read-only — what a
    CUDA copy may page-lock. Linux breaks copy-on-write up front for a long-term pin of a writable
    private mapping, read-only pin or not (every page copied: 0.8 s a GiB on an H100 host), and on
    a huge-page tmpfs such a pin never returned (``bench/gpu_checkpoint.py``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if shared_read_only:
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        else:
            mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": read-only on purpose
        whole = torch.frombuffer(mm, dtype=torch.uint8)
    populate_read(whole.data_ptr(), size)
    return whole


def map_shard(shard: dict[str, Any], pins: list[Registration] | None = None) -> torch.Tensor:
    """A shard's bytes over a private mapping of its file (``map_file``); with ``pins``, over a
    shared read-only one, page-locked for CUDA copies, its registration appended there for the
    caller to release."""
    whole = map_file(shard["path"], shared_read_only=pins is not None)
    begin, n = int(shard["offset"]), int(shard["nbytes"])
    if begin + n > whole.numel():  # checked before a pin, which nobody would release after this raise
        raise CorruptError(f"shard {shard['path']} is shorter than its header says")
    if pins is not None:
        pins.append(Registration(whole, read_only=True))
    return whole[begin : begin + n]


def role_storages(
    role: str, shards: dict[str, Any], peers: list[str], step: int, owned: bool, pins: list[Registration] | None = None
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """``role``'s shard header and its storages: private ones from its own shard, razored ones
    rebuilt from its dp group's (``peers``) slices. ``owned``: copies no slot reuse can touch
    (but for storages saved from a device, which go onto one: ``_onto_devices``). ``pins``:
    page-lock the mapped shards (``map_shard``)."""
    me = shards[role]
    header: dict[str, Any] = me["header"]
    mine = map_shard(me, pins)
    mapped = {r: map_shard(shards[r], pins) for r in peers if r in shards and r != role}
    pieces = [(shards[r]["header"]["piece"], shards[r]["header"]["private_nbytes"], mapped.get(r, mine)) for r in peers if r in shards]
    storages = []
    lo, hi = header["piece"]
    private = header["private_nbytes"]
    for entry in header["storages"]:
        off, n = entry["offset"], entry["nbytes"]
        if entry["stream"] == "private":
            part = mine[off : off + n]
        elif lo <= off and off + n <= hi:
            part = mine[private + off - lo : private + off - lo + n]
        else:
            storages.append(_assemble(off, n, pieces, step))  # already a fresh buffer
            continue
        storages.append(part.clone() if owned and (pins is None or "device" not in entry) else part)
    return header, storages


def _saved_on_device(header: dict[str, Any]) -> bool:
    return any("device" in e for e in header["storages"])


def _holds_cuda(node: Any) -> bool:
    if isinstance(node, torch.Tensor):
        return node.is_cuda
    if isinstance(node, dict):
        return any(_holds_cuda(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return any(_holds_cuda(v) for v in node)
    return False


def _onto_devices(
    header: dict[str, Any], storages: list[torch.Tensor], copy: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], None]
) -> list[torch.Tensor]:
    """Storages saved from a CUDA device copied onto it again (the current device where this
    process has fewer), straight from the mapped (pinned) shard: a fresh restore of GPU state
    comes back on the GPU."""
    out = list(storages)
    pairs = []
    for i, entry in enumerate(header["storages"]):
        if "device" in entry:
            saved = torch.device(entry["device"])
            index = saved.index if saved.index is not None and saved.index < torch.cuda.device_count() else torch.cuda.current_device()
            out[i] = torch.empty(entry["nbytes"], dtype=torch.uint8, device=torch.device("cuda", index))
            pairs.append((out[i], storages[i]))
    copy(pairs)
    return out


def _assemble(off: int, n: int, pieces: list[tuple[list[int], int, torch.Tensor]], step: int) -> torch.Tensor:
    """A razored storage rebuilt from the dp group's slices of the replicated stream."""
    out = torch.empty(n, dtype=torch.uint8)
    covered = 0
    for (lo, hi), private, shard in pieces:
        a, b = max(off, lo), min(off + n, hi)
        if a < b:
            out[a - off : b - off].copy_(shard[private + a - lo : private + b - lo])
            covered += b - a
    if covered != n:
        raise CorruptError(
            f"step {step}: the dp group's slices {[p[0] for p in pieces]} cover {covered} of the {n} bytes at "
            f"{off} of the replicated stream; a peer's shard is missing or was saved with another layout"
        )
    return out
