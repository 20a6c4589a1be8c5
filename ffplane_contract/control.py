"""The local control channel between workers and their node daemon: one Unix socket, JSON lines.

A per-batch HTTP request would cost more than the batch lookup itself; a Unix-socket round trip
costs tens of microseconds. The socket (``files.socket_path``) is created mode 0600 inside the
daemon's root, so only the node's training user reaches it. Every request is one JSON object on
one line with its ``op``; every reply is one line, ``{"ok": true, ...}`` with the fields of the
request's reply type, or ``{"ok": false, "status": S, "kind": K, "error": E}`` where ``kind``
names the ``ffplane_contract.errors`` class the daemon raised. Replies come in request order,
so a client may send several requests before reading their replies.

Data: ``Open`` a reader's stream (job, dp rank), then ``Get`` a step: the reply names the
published file holding it (a file holds one step, or a run of consecutive small steps, named for
its first). The connection's last ``Get`` is the reader's position (it drives prefetch and
eviction): a reader reading steps from a file it has mapped sends one on entering the file, not
for each of its steps; closing the connection removes the reader but keeps its cached steps.

State (``Checkpointer``): ``Alloc`` a role's slots, ``Begin`` a slot for a step, ``Commit`` it
(the daemon checksums and records it; the reply hands out ``next``, the slot for the role's next
save, so a steady-state save is this one request; ``static`` names the header's unchanging part,
sent as ``static_header`` only when it changed), ``Abort``, ``Restorable`` and ``Verify``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from ffplane_contract.errors import FFPlaneError, error_from, kind_of
from ffplane_contract.limits import check_name, check_step
from ffplane_contract.shard import check_header

MAX_LINE = 64 << 20  # a commit carries the shard header (one entry per tensor)


def _dp_rank(value: object) -> int:
    rank = int(value)  # type: ignore[call-overload]
    if rank < 0:
        raise ValueError(f"invalid dp_rank {rank}")
    return rank


def _roles(value: object) -> list[str]:
    if not isinstance(value, list):
        raise ValueError("'roles' must be a list of role names")
    return [check_name(r) for r in value]


def _object(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {type(value).__name__}")
    return value


# How each request field is checked as it arrives (names and steps become paths on the node). A
# field whose default is None also takes null.
_CHECKS: dict[str, Any] = {
    "job": check_name,
    "role": check_name,
    "dp_rank": _dp_rank,
    "token": str,
    "slot": str,
    "nbytes": int,
    "header": _object,
    "save_block_s": float,
    "reserved": bool,
    "settled": bool,
    "static": str,
    "static_header": _object,
    "verify": bool,
    "below": int,
    "roles": _roles,
    "step": check_step,
}


class Request:
    """A request to the daemon: ``op`` names it on the wire, ``Reply`` is the type of its answer."""

    op: ClassVar[str]
    Reply: ClassVar[type[Any]]

    def __init_subclass__(cls, op: str = "", reply: type[Any] | None = None, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if op:
            cls.op, cls.Reply = op, reply or Done

    def wire(self) -> dict[str, Any]:
        return {"op": self.op, **self.__dict__}


@dataclass(frozen=True)
class Done:
    """The answer of a request that only succeeds or fails."""


@dataclass(frozen=True)
class OpenReply:
    root: str  # the daemon's root folder
    steps: str  # the stream's folder, relative to ``root``


@dataclass(frozen=True)
class GetReply:
    path: str  # the published file holding the step (it and maybe the next ones), relative to the root
    nbytes: int
    hit: bool  # cached before it was asked for


@dataclass(frozen=True)
class AllocReply:
    paths: list[str]  # the role's slot files, absolute
    commit_wait_s: float  # the longest a commit's answer waits for its replica


@dataclass(frozen=True)
class Grant:
    """A slot handed out for one save: by ``Begin``, or reserved in a commit's reply."""

    slot: str  # relative to the daemon's root: how requests name it
    path: str  # absolute: where the worker maps it
    # the slot holds the role's older committed version, which only a settled save may
    # overwrite (``Commit.settled``); an unsettled one sends ``Begin`` instead
    settled_only: bool = False


@dataclass(frozen=True)
class CommitReply:
    checksum: str
    next: Grant | None  # the role's next save's slot; None when none is free now


@dataclass(frozen=True)
class RestorableReply:
    step: int | None
    source: str | None  # "memory" or "durable"
    shards: dict[str, dict[str, Any]]  # role → path, offset, nbytes, checksum, header, kind
    message: str | None = None  # why it is not the newest step, or why there is none
    corrupt: bool = False  # every copy failed its checksum
    roles: list[str] = field(default_factory=list)  # the roles of the layout ``step`` was saved with


@dataclass(frozen=True)
class VerifyReply:
    intact: bool
    corrupt: list[str]  # the roles whose copy here failed (and was dropped)


@dataclass(frozen=True)
class Open(Request, op="open", reply=OpenReply):
    """Read dp rank ``dp_rank`` of ``job`` on this connection; ``token`` lets the daemon fetch
    the job's batches from the data server."""

    job: str
    dp_rank: int
    token: str | None = None  # lets the daemon fetch this job's batches


@dataclass(frozen=True)
class Get(Request, op="get", reply=GetReply):
    """Move this reader to ``step``; answered once the step is cached and published. The last
    ``Get`` of a connection is its reader's position: it drives prefetch and eviction."""

    step: int


@dataclass(frozen=True)
class Alloc(Request, op="alloc", reply=AllocReply):
    """Create (or resize) the role's three slots, each of ``nbytes``, inside the daemon's budget;
    the reply names the files to map."""

    job: str
    role: str
    nbytes: int


@dataclass(frozen=True)
class Begin(Request, op="begin", reply=Grant):
    """A free slot of the role for the save of ``step`` (when no commit reply reserved one).
    None free now raises ``SlotBusyError``; no slots at all, ``NoSlotsError``."""

    job: str
    role: str
    step: int
    settled: bool = False  # as ``Commit.settled``: the save may overwrite all but the newest version


@dataclass(frozen=True)
class Abort(Request, op="abort", reply=Done):
    """Give a slot back unsaved (the copy into it failed, or it has the wrong size now)."""

    job: str
    role: str
    slot: str


@dataclass(frozen=True)
class Commit(Request, op="commit", reply=CommitReply):
    """Record the save in ``slot``: the daemon checksums it, keeps it as the role's newest
    version, and answers once its replica exists (at most ``commit_wait_s``)."""

    job: str
    role: str
    step: int
    slot: str
    nbytes: int
    header: dict[str, Any]  # the per-step part (the tree)
    save_block_s: float = 0.0
    reserved: bool = False  # the slot came with the previous commit's reply
    static: str = ""  # digest of the header's static part
    static_header: dict[str, Any] | None = field(default=None)  # sent when it changed
    # every rank's previous save was answered before a collective this rank then passed
    # (``settle_all``): no role needs a version older than this role's newest, so the save may
    # overwrite it and its replica (docs/decisions.md, "Two slots and two replica files per role")
    settled: bool = False

    def __post_init__(self) -> None:
        if self.static_header is not None and not self.static:
            raise ValueError("'static_header' must be a JSON object, sent with its digest 'static'")
        if self.static:
            check_name(self.static)
        # a shard without its tree restores nothing: refused now, not found out at a restore
        if "tree_json" not in self.header and "tree" not in self.header:
            raise ValueError("a commit's 'header' carries the state's tree ('tree_json')")
        check_header(self.header)
        if self.static_header is not None:
            check_header(self.static_header)


@dataclass(frozen=True)
class Restorable(Request, op="restorable", reply=RestorableReply):
    """The step to restore and where its shards are (pulled here first when they are
    elsewhere)."""

    job: str
    verify: bool = True
    below: int | None = None
    roles: list[str] | None = None  # the asker's role and its dp peers: makes the step job-wide
    step: int | None = None  # the step the ranks agreed on


@dataclass(frozen=True)
class Verify(Request, op="verify", reply=VerifyReply):
    """Check the checksums of this node's copies of ``step`` of ``roles`` (default: every role
    saving here). A copy that fails is dropped, so the next ``Restorable`` takes another."""

    job: str
    step: int
    roles: list[str] | None = None


@dataclass(frozen=True)
class Ping(Request, op="ping", reply=Done):
    """Is the daemon there? (Answered with ``Done``.)"""


@dataclass(frozen=True)
class Bye(Request, op="bye", reply=Done):
    """The sending process is ending cleanly (its interpreter exits with no unhandled exception):
    when it is gone, the daemon does not report it to the coordinator as a failed worker. Sent on
    a connection of its own, answered before the process exits."""


REQUESTS: dict[str, type[Request]] = {cls.op: cls for cls in (Open, Get, Alloc, Begin, Abort, Commit, Restorable, Verify, Ping, Bye)}


def encode(message: Request | Any) -> bytes:
    """One line: a request, or a reply (``ok`` added)."""
    body = message.wire() if isinstance(message, Request) else {"ok": True, **_plain(message)}
    return json.dumps(body).encode() + b"\n"


def encode_error(exc: FFPlaneError) -> bytes:
    return json.dumps({"ok": False, "status": exc.status, "kind": kind_of(exc), "error": str(exc)}).encode() + b"\n"


def decode_request(line: bytes) -> Request:
    """The request on ``line``; ValueError (the daemon answers 400) saying what is wrong."""
    msg = json.loads(line)
    if not isinstance(msg, dict):
        raise ValueError("expected a JSON object")
    cls = REQUESTS.get(msg.get("op"))  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"unknown op {msg.get('op')!r}; expected {', '.join(REQUESTS)}")
    kwargs = {}
    for name, nullable in _fields_of(cls):
        if name in msg:
            value = msg[name]
            try:
                kwargs[name] = None if value is None and nullable else _CHECKS[name](value)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{cls.op} field {name!r}: {exc}") from None
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a field without a default is missing
        raise ValueError(f"{cls.op}: {exc}") from None


def decode_reply(request: Request, reply: dict[str, Any]) -> Any:
    """The typed answer to ``request``, or the error the daemon raised."""
    if not reply.get("ok"):
        raise error_from(int(reply.get("status", 500)), str(reply.get("error")), reply.get("kind"))
    cls = request.Reply
    if cls is CommitReply:
        nxt = reply.get("next")
        grant = None if not nxt else Grant(str(nxt["slot"]), str(nxt["path"]), nxt.get("settled_only") is True)
        return CommitReply(str(reply["checksum"]), grant)
    return cls(**{k: reply[k] for k, _ in _fields_of(cls) if k in reply})


_FIELDS: dict[type, tuple[tuple[str, bool], ...]] = {}


def _fields_of(cls: type) -> tuple[tuple[str, bool], ...]:
    """(name, takes null) of each field; once per message type (``fields`` costs microseconds)."""
    found = _FIELDS.get(cls)
    if found is None:
        found = _FIELDS[cls] = tuple((f.name, f.default is None) for f in fields(cls))
    return found


def _plain(reply: Any) -> dict[str, Any]:
    out = dict(reply.__dict__)
    if isinstance(reply, CommitReply) and reply.next is not None:
        out["next"] = dict(reply.next.__dict__)
    return out
