"""What moving shards between node daemons takes, whatever carries the bytes: the ``Transport``
interface the ring policy (``statestore.ring``) and the state service use, and its error.

A transport has two halves: the client here (push a shard held on this node to a peer, pull a
shard from a holder, ask a holder about a shard) and the server on every daemon that takes those
requests. Whatever the carrier, the receiver verifies the whole-shard checksum before a replica
counts, and a pulled shard is verified before ``pull`` returns; ``tests/statestore/test_transport.py``
is the contract every transport passes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ffplane_contract.errors import ConflictError, CorruptError, FFPlaneError, NotFoundError
from statestore.replicas import Replica, ReplicaStore
from statestore.shard import LocalShard


class PeerError(FFPlaneError):
    """A shard move failed; ``status`` is the peer's answer. What the ring policy and the state
    service act on: ``conflict``, the shard was replaced on one side meanwhile (or the receiver
    holds part of it); ``corrupt``, the bytes failed their checksum; ``missing``, the holder has
    no such shard; anything else, try again later. ``unreachable``: no connection could be made
    at all (refused, or timed out), which a ring successor that still beats is reported for."""

    def __init__(self, message: str, status: int = 502, unreachable: bool = False) -> None:
        super().__init__(message, status)
        self.unreachable = unreachable

    @property
    def conflict(self) -> bool:
        return self.status == ConflictError.status

    @property
    def corrupt(self) -> bool:
        return self.status == CorruptError.status

    @property
    def missing(self) -> bool:
        return self.status == NotFoundError.status


@dataclass(frozen=True)
class RemoteShard:
    """What a holder says of a shard it holds."""

    nbytes: int
    checksum: str
    header: dict[str, Any] = field(default_factory=dict)
    kind: str = ""  # "primary", "replica" or "pulled", on the holder
    header_digest: str = ""  # of the whole header, checked by whoever takes the bytes


@dataclass
class PushCounts:
    """How pushes went, for the daemon's ``/v1/state``."""

    in_one_request: int = 0  # sent whole in one exchange, the common case
    resumed: int = 0  # sent from the offset the receiver said it held (a retry, part already there)
    already_there: int = 0  # the receiver held it complete: no bytes sent


class Transport(ABC):
    """The client half of shard moves. Addresses (``base``) are the peers' as the coordinator
    lists them (``successor_address``, members' ``address``)."""

    def __init__(self) -> None:
        self.counts = PushCounts()

    @abstractmethod
    async def start(self) -> None:
        """Open what the transfers need (connections, sessions); called on the event loop."""

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    async def push(
        self,
        base: str,
        shard: LocalShard,
        source: str,
        newest: int | None,
        urgent: Callable[[], bool] = lambda: False,
        maybe_there: bool = False,
    ) -> int:
        """Send ``shard`` to the daemon at ``base``, which verifies and commits it as a replica
        from ``source`` (this node); returns the bytes sent. ``newest``: this node's newest
        committed step of the role, when it is the role's primary (the receiver drops its replicas
        above it: a future the sender rewound from); None for a replica held for a dead primary.
        ``urgent``: asked while the push waits at the link gate, whether it may pass TRAIN's
        signals. ``maybe_there``: sent before, the receiver may hold it already; a
        transport asks before sending it again. Raises ``PeerError``."""

    @abstractmethod
    async def pull(self, base: str, replicas: ReplicaStore, job: str, role: str, step: int, source: str) -> Replica:
        """Fetch a committed shard from the daemon at ``base`` into ``replicas`` as a pulled
        shard, verified against its checksum. Raises ``PeerError``, or the store's error (422:
        the bytes failed their checksum)."""

    @abstractmethod
    async def shard_meta(self, base: str, job: str, role: str, step: int) -> RemoteShard:
        """Size, checksum and header of a shard the daemon at ``base`` holds. Raises ``PeerError``."""
