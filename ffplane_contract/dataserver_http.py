"""The data server's HTTP bodies, defined once: what its routes take and answer, what a node
daemon's heartbeat sends and reads back, what the client library reads of a job.

The data server validates requests against these models (and publishes them in its OpenAPI
document); the daemon builds its heartbeat with ``HeartbeatBody`` and reads the answer as a
``RingView``; ``trainer_client.jobs`` sends ``JobCreate`` and ``GenerationCreate`` and reads
``JobView``. Requests are strict (``true`` is no integer, a misspelt field is refused); answers
are read leniently, so a newer server may add fields.

Every error a route answers has the body ``ErrorDetail``; which class of
``ffplane_contract.errors`` stands for which status is said there, once.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, with_config
from typing_extensions import NotRequired, TypedDict

from ffplane_contract.limits import LAYOUT_LIMIT, NAME_LEN, NAME_PATTERN, NODE_ID_PATTERN, SEED_LIMIT, STEP_LIMIT

__all__ = [
    "DroppedRecord",
    "ErrorDetail",
    "GenerationCreate",
    "GenerationView",
    "HeartbeatBody",
    "InventoryEntry",
    "JobCreate",
    "JobView",
    "Name",
    "NodeId",
    "RingView",
    "ShortStr",
    "UdpSession",
    "UnreachableAnswer",
    "UnreachableReport",
    "WorkerInfo",
]

_ROLE_LIMIT = 1 << 20  # roles a layout may have (dp x pp x tp), as listed in an inventory entry

Name = Annotated[str, Field(min_length=1, max_length=NAME_LEN, pattern=NAME_PATTERN)]  # a job, role or dataset
NodeId = Annotated[str, Field(min_length=1, max_length=NAME_LEN, pattern=NODE_ID_PATTERN)]
ShortStr = Annotated[str, Field(min_length=1, max_length=NAME_LEN)]


class ErrorDetail(BaseModel):
    """Every 4xx answer: what was wrong and what to do about it."""

    detail: str


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


# --- jobs ----------------------------------------------------------------------------------------


class JobCreate(_Strict):
    name: Name
    dataset: Name
    dp: int = Field(ge=1, le=LAYOUT_LIMIT)
    batch_per_rank: int = Field(ge=1, le=LAYOUT_LIMIT)
    seed: int = Field(default=0, ge=0, lt=SEED_LIMIT, description="any unsigned 64-bit integer")
    max_steps: int | None = Field(default=None, ge=1, le=STEP_LIMIT)


class GenerationCreate(_Strict):
    start_step: int = Field(ge=1, lt=STEP_LIMIT)
    dp: int = Field(ge=1, le=LAYOUT_LIMIT)
    batch_per_rank: int = Field(ge=1, le=LAYOUT_LIMIT)
    replan_served: StrictBool = Field(
        default=False,
        description="accept a start at or before the newest step served: the batches served from start_step on "
        "were only prefetched by node caches and no worker trained on them (never before a committed step)",
    )


class GenerationView(BaseModel):
    start_step: int
    dp: int
    batch_per_rank: int


class JobView(BaseModel):
    name: str
    dataset: dict[str, Any] | None = Field(description="the dataset's description, or {name, error} if it cannot be opened")
    seed: int | None
    max_steps: int | None
    generations: list[GenerationView]
    served_step: int | None = Field(description="the newest step whose batches were handed out; a generation must start after it")
    broken: str | None = Field(default=None, description="why the job's record could not be loaded; it serves nothing until fixed")


# --- nodes: heartbeats and the ring --------------------------------------------------------------


# TypedDicts, not models: validated as strictly, but they stay the dicts the coordinator keeps
# (a full heartbeat's inventory is parsed in ~1.5x the time of the unchecked dicts, not 2.5x).
# Keys a later daemon may add are dropped.
@with_config(ConfigDict(strict=True))
class InventoryEntry(TypedDict):
    """One committed version of a role held on a node."""

    step: Annotated[int, Field(ge=0, lt=STEP_LIMIT)]
    checksum: NotRequired[Annotated[str, Field(max_length=128)]]
    nbytes: NotRequired[Annotated[int, Field(ge=0, lt=1 << 62)]]
    layout_roles: NotRequired[Annotated[list[ShortStr], Field(max_length=_ROLE_LIMIT)]]
    replica_of: NotRequired[ShortStr]


@with_config(ConfigDict(strict=True))
class WorkerInfo(TypedDict):
    """A worker process of a node, as its daemon knows it."""

    pid: Annotated[int, Field(ge=0, lt=1 << 32)]
    job: NotRequired[ShortStr]
    role: NotRequired[ShortStr]
    dp_rank: NotRequired[Annotated[int, Field(ge=0, lt=LAYOUT_LIMIT)]]


class UdpSession(_Strict):
    session: str = Field(pattern=r"^[0-9a-f]{16}$")  # the daemon process's random UDP session id
    counter: int = Field(ge=0, lt=1 << 64)  # the highest message counter it has used
    inv_version: int = Field(ge=0, lt=1 << 64)  # the version of the inventory in this heartbeat


class HeartbeatBody(_Strict):
    """A node daemon's full heartbeat (``POST /v1/nodes/heartbeat``)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    node_id: NodeId
    address: str = Field(
        min_length=1,
        max_length=256,
        pattern=r"^https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?/?$",
        description="http://HOST:PORT its peers reach it at (not loopback across hosts, not 0.0.0.0)",
    )
    budget_bytes: int = Field(ge=0, lt=1 << 62)
    # The per-job records: each is checked on its own by the coordinator (dataserver.records), so
    # one that fails is dropped and named in the answer, not the whole heartbeat.
    inventory: dict[str, Any] = Field(
        default_factory=dict, max_length=1024, description="job → role → committed versions held on the node (InventoryEntry)"
    )
    workers: list[Any] = Field(default_factory=list, max_length=4096, description="the node's workers (WorkerInfo)")
    exited: list[Any] = Field(default_factory=list, max_length=4096, description="workers that exited since the last one (WorkerInfo)")
    udp: UdpSession | None = None  # present when the daemon will send UDP beats


class DroppedRecord(BaseModel):
    """One record a heartbeat's check left out, and why."""

    model_config = ConfigDict(frozen=True)
    job: str  # "" when the record names none
    record: str  # where it was: inventory.JOB.ROLE[i], inventory.JOB, workers[i], exited[i]
    reason: str


class RingView(BaseModel):
    """The ring as the coordinator has it: a heartbeat's answer and ``GET /v1/nodes/view``."""

    epoch: int
    version: int
    ring: list[str]
    members: dict[str, str]
    dead: list[str]
    successor: str | None
    successor_address: str | None
    udp_port: int | None
    dropped: list[DroppedRecord] | None = None  # a heartbeat's answer: the records it left out (the first 32), if any
    dropped_count: int | None = None  # how many it left out


class UnreachableReport(_Strict):
    reporter: NodeId  # the node that could not connect


class UnreachableAnswer(BaseModel):
    node_id: str
    unreachable: bool  # whether the node is out of the ring now
    detail: str
