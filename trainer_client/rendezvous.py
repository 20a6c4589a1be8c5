"""torchrun's rendezvous on etcd, told of dead nodes by ffplane's coordinator: ``--rdzv-backend ffplane``.

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend ffplane \\
        --rdzv-endpoint 10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379 --rdzv-id job1 \\
        --rdzv-conf keep_alive_interval=1,keep_alive_max_attempt=3 train.py

Registered with torch.distributed.elastic through the ``torchrun.handlers`` entry point, so stock
torchrun loads it. What it changes against ``--rdzv-backend c10d`` (decisions.md, "No single
point of failure: etcd holds what outlives a host"):

* **The rendezvous state and the agents' store live in etcd**, a cluster run off the training
  nodes (or on three of them), reached through every member's endpoint: the loss of any training
  node, the one whose agent was rank 0 included, leaves the rendezvous running. torch's
  ``c10d`` backend keeps both in a TCPStore on one training node (``is_host``); losing that
  node ends the job on every survivor.
* **The workers' store is made afresh by each round's rank 0** (torch's TCPStore sharing is off):
  a survivor never points its workers at the store of a rank 0 that died.
* **A node the coordinator declared dead leaves the rendezvous at once**, once its agent's
  keep-alive has been silent for two intervals too (a daemon restarting on a live node is not a
  dead agent). The data server publishes the nodes it declares dead (``dataserver --etcd``,
  ~1.6 s after a node falls silent); every agent maps rendezvous members to ffplane node names
  (``--rdzv-conf node=``, else ``$FFPLANE_NODE``, else the host name, as the daemon's
  ``--node-id`` defaults). A survivor
  whose peer is dead then restarts its workers even while they hang in a collective on a link
  that died without a reset, and the dead member is dropped from the next round without waiting
  out its keep-alive. Warm spares (agents started beyond ``--nnodes``'s maximum) wait in torch's
  redundancy list and join that round.

Agents and the data server talk to etcd only; no pickle crosses it that torch did not put there
(torch's own rendezvous state is a pickle, opaque here, as it is in every torch backend).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousStateError

from ffplane_runtime.etcd import DEAD_PREFIX, Etcd, EtcdUnavailable, KeyValue

try:  # torch's dynamic rendezvous, private parts included: pinned by pyproject's torch range
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousBackend,
        RendezvousSettings,
        RendezvousTimeout,
        _Action,
        _BackendRendezvousStateHolder,
        _get_timeout,
        _remove_participant_epilogue,
        _RendezvousContext,
        _RendezvousOpExecutor,
    )
except ImportError as exc:  # pragma: no cover - a torch outside pyproject's range
    raise ImportError(f"ffplane's rendezvous needs torch's dynamic rendezvous of torch 2.4-2.14 (redundancy list): {exc}") from exc

log = logging.getLogger(__name__)

BACKEND = "ffplane"
RDZV_PREFIX = "/ffplane/rdzv/"
_POLL_S = 0.02  # a store key someone waits for is looked for this often
_PEEK_RETRY_S = 0.5
_MIN_ATTEMPTS = 3
_SYNC_S = 1.0  # torch's wait between looks at a state it waits on ...
_PROMPT_S = 0.1  # ... and ours  # the dead-node check runs in the agent's monitor loop: never hold it up long


class EtcdStore(dist.Store):
    """A c10d store over etcd (the agents' barriers and rank 0's address): string keys under
    ``prefix``, values as bytes, counters as decimal text."""

    def __init__(self, etcd: Etcd, prefix: str, timeout: timedelta = timedelta(seconds=300)) -> None:
        super().__init__()  # pybind's trampoline needs it
        self._etcd = etcd
        self._prefix = prefix.rstrip("/") + "/"
        self.set_timeout(timeout)

    def _key(self, key: str | bytes) -> bytes:
        return self._prefix.encode() + (key.encode() if isinstance(key, str) else key)

    @staticmethod
    def _bytes(value: str | bytes | list[int]) -> bytes:
        return value.encode() if isinstance(value, str) else bytes(value)

    def set(self, key: str, value: str | bytes | list[int]) -> None:
        self._etcd.put(self._key(key), self._bytes(value))

    def get(self, key: str) -> bytes:
        kv = self._wait_for(key, self.timeout)  # type: ignore[attr-defined]  # c10d.Store.timeout, untyped
        return kv.value

    def add(self, key: str, num: int) -> int:
        k = self._key(key)
        while True:
            kv = self._etcd.get(k)
            new = (int(kv.value) if kv else 0) + num
            written, _ = self._etcd.cas(k, str(new).encode(), kv.mod_revision if kv else 0)
            if written is not None:
                return new

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        # TCPStore's rule: a missing key is set only when ``expected`` is empty
        k, want = self._key(key), self._bytes(expected)
        while True:
            kv = self._etcd.get(k)
            if kv is None and want:
                return want
            if kv is not None and kv.value != want:
                return kv.value
            written, _ = self._etcd.cas(k, self._bytes(desired), kv.mod_revision if kv else 0)
            if written is not None:
                return self._bytes(desired)

    def check(self, keys: list[str]) -> bool:
        return all(self._etcd.get(self._key(k)) is not None for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        for key in keys:
            self._wait_for(key, timeout or self.timeout)  # type: ignore[attr-defined]

    def delete_key(self, key: str) -> bool:
        return self._etcd.delete(self._key(key))

    def num_keys(self) -> int:
        return len(self._etcd.get_prefix(self._prefix.encode()))

    def _wait_for(self, key: str, timeout: timedelta) -> KeyValue:
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            kv = self._etcd.get(self._key(key))
            if kv is not None:
                return kv
            if time.monotonic() > deadline:
                raise LookupError(f"key {key!r} did not appear in the rendezvous store ({self._prefix}) within {timeout}")
            time.sleep(_POLL_S)


class EtcdRendezvousBackend(RendezvousBackend):
    """torch's rendezvous state (an opaque blob) under one etcd key, written by compare-and-set
    on the key's ``mod_revision``."""

    def __init__(self, etcd: Etcd, run_id: str) -> None:
        self._etcd = etcd
        self._key = f"{RDZV_PREFIX}{run_id}/state".encode()

    @property
    def name(self) -> str:
        return BACKEND

    def get_state(self) -> tuple[bytes, Any] | None:
        try:
            kv = self._etcd.get(self._key)
        except EtcdUnavailable as exc:
            raise RendezvousConnectionError(str(exc)) from exc
        return (kv.value, kv.mod_revision) if kv else None

    def set_state(self, state: bytes, token: Any | None = None) -> tuple[bytes, Any, bool] | None:
        if token is not None and not isinstance(token, int):
            raise RendezvousStateError(f"a rendezvous token is an etcd revision, not {token!r}")
        try:
            written, current = self._etcd.cas(self._key, state, token or 0)
        except EtcdUnavailable as exc:
            raise RendezvousConnectionError(str(exc)) from exc
        if written is not None:
            return state, written, True
        return (current.value, current.mod_revision, False) if current else None


class DeadPeers:
    """Which rendezvous members ran on a node the coordinator declared dead *after* the member
    joined (a replacement reusing the node's name is not one of them)."""

    def __init__(self, etcd: Etcd, run_id: str) -> None:
        self._etcd = etcd
        self._members = f"{RDZV_PREFIX}{run_id}/members/".encode()
        self._said: set[str] = set()
        self._lock = threading.Lock()
        self.last: set[str] = set()  # the members the newest sync let go: a sync asks once, its callers read this

    def register(self, member: str, node: str) -> None:
        """Say that rendezvous member ``member`` (torch's node descriptor) runs on ``node``."""
        self._etcd.put(self._members + member.encode(), node.encode())

    def dead(self) -> dict[str, str]:
        """Members on nodes declared dead (member → node); empty when etcd does not answer in
        time (torch's keep-alive still drops them then)."""
        try:
            dead = {kv.key[len(DEAD_PREFIX) :].decode(): kv.mod_revision for kv in self._etcd.get_prefix(DEAD_PREFIX, _PEEK_RETRY_S)}
            if not dead:
                return {}
            members = self._etcd.get_prefix(self._members, _PEEK_RETRY_S)
        except EtcdUnavailable:
            return {}
        return {
            kv.key[len(self._members) :].decode(): kv.value.decode()
            for kv in members
            if kv.value.decode() in dead and dead[kv.value.decode()] > kv.mod_revision
        }

    def leaving(self, members: dict[str, str]) -> None:
        """``members`` (member → node) leave the rendezvous: the answer callers read (``last``),
        said once per member."""
        self.last = set(members)
        with self._lock:
            for member in members.keys() - self._said:
                # logging's last resort prints it in torchrun's output when nothing configured it
                log.warning(
                    f"ffplane rendezvous: the coordinator declared node {members[member]} dead; member {member} leaves the rendezvous now"
                )
            self._said |= members.keys()


class _StateHolder(_BackendRendezvousStateHolder):
    """torch's state holder that also drops members on dead nodes when it syncs."""

    def __init__(self, backend: RendezvousBackend, settings: RendezvousSettings, peers: DeadPeers) -> None:
        super().__init__(backend, settings, cache_duration=0)
        self.peers = peers

    def _sanitize(self) -> None:
        super()._sanitize()
        state = self._state
        verdict = self.peers.dead()
        # The verdict is about the node's daemon. A member whose agent still beats is alive: its
        # daemon is restarting (killed, or rebuilding its index), and dropping the member split
        # the round — the other agent reopened it after this one had finished joining, which then
        # waited in the rank barrier of a round nobody else was in (the 1,000-failure soak hung
        # 120 s at failure 349). A dead agent has been silent for the 1.6 s the verdict takes;
        # two keep-alive intervals (torch's timer may skip a beat) confirm it.
        silent = datetime.now(timezone.utc) - 2 * self._settings.keep_alive_interval
        gone = {repr(n): verdict[repr(n)] for n, beat in state.last_heartbeats.items() if repr(n) in verdict and beat < silent}
        self.peers.leaving(gone)
        if not gone:
            return
        removed = False
        for node in [n for n in state.last_heartbeats if repr(n) in gone]:
            del state.last_heartbeats[node]
            removed = state.participants.pop(node, None) is not None or removed
            state.wait_list.discard(node)
            state.redundancy_list.discard(node)
        if removed and state.complete:
            # A complete round that lost a member can never run: a member still in its join
            # would finish with the old ranks and wait for the removed one's (its store address,
            # its workers) until a timeout, while a member declared dead only for a moment (a
            # slow daemon restart) waits for a next round that never comes — the 1,000-failure
            # soak hung so. Open the next round instead: everyone alive joins it.
            state.complete, state.round, state.deadline = False, state.round + 1, None
            state.participants.clear()
        elif removed:
            _remove_participant_epilogue(state, self._settings)


class _PromptExecutor(_RendezvousOpExecutor):
    """torch's op executor, but where it would sleep a whole second before looking at the state
    again (a node waiting for the others, or for the next round), it looks every 0.1 s: each
    restart round had waited out up to several such seconds."""

    def __init__(self, inner: Any, holder: _BackendRendezvousStateHolder, node: Any, settings: RendezvousSettings) -> None:
        self._inner, self._holder, self._node, self._settings = inner, holder, node, settings

    def run(self, state_handler: Callable[[Any, float], Any], deadline: float, update_deadline: Any = None) -> None:
        def prompt(ctx: Any, op_deadline: float) -> Any:
            action = state_handler(ctx, op_deadline)
            until = time.monotonic() + _SYNC_S
            while action == _Action.SYNC and time.monotonic() < until:
                time.sleep(_PROMPT_S)
                self._holder.sync()
                # torch applies the action to the state it read last: make that the fresh one
                self._inner._state = self._holder.state
                action = state_handler(_RendezvousContext(self._node, self._holder.state, self._settings), op_deadline)
            return action

        self._inner.run(prompt, deadline, update_deadline)


class FFPlaneRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous whose ``num_nodes_waiting`` counts a dead peer as a node
    waiting: the agent then restarts its workers for a new round at once."""

    def __init__(self, node: Any, settings: RendezvousSettings, store: dist.Store, holder: _StateHolder, ffplane_node: str) -> None:
        super().__init__(node, settings, BACKEND, store, holder)
        self._peers, self._ffplane_node = holder.peers, ffplane_node
        self._round: set[str] = set()  # the members of the round this agent's workers run in
        self._round_no = -1  # and its number
        self._op_executor = _PromptExecutor(self._op_executor, holder, node, settings)

    def next_rendezvous(self) -> Any:
        self._peers.register(repr(self._this_node), self._ffplane_node)
        info = super().next_rendezvous()
        self._round = {repr(n) for n in self._state_holder.state.participants}
        self._round_no = self._state_holder.state.round
        return info

    def num_nodes_waiting(self) -> int:
        # the sync inside asked which members are dead (and dropped them from the shared state):
        # judge by the round the workers run in
        waiting = super().num_nodes_waiting()
        # a member of this round declared dead, or the round reopened for that by another agent
        # (_StateHolder._sanitize): restart for the next one
        return waiting + 1 if self._round & self._peers.last or self._state_holder.state.round > self._round_no else waiting


def create_handler(params: RendezvousParameters) -> FFPlaneRendezvousHandler:
    """The handler torchrun builds for ``--rdzv-backend ffplane``; ``--rdzv-endpoint`` lists the
    etcd members (host:port, comma-separated)."""
    if not params.endpoint:
        raise ValueError("--rdzv-backend ffplane needs --rdzv-endpoint host:port[,host:port...] naming the etcd members")
    # A survivor must not hand its workers the store address of a rank 0 that died: each round's
    # rank 0 publishes a fresh one (torch's documented opt-out of sharing the agent's TCPStore).
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    etcd = Etcd(params.endpoint, timeout_s=1.0, retry_s=float(params.get_as_int("etcd_retry_timeout", 30) or 30))
    node = str(params.get("node") or os.environ.get("FFPLANE_NODE") or socket.gethostname())
    timeout = RendezvousTimeout(*(_get_timeout(params, k) for k in ("join", "last_call", "close", "heartbeat")))
    attempts = params.get_as_int("keep_alive_max_attempt", 3) or 3
    if attempts < _MIN_ATTEMPTS:
        # torch's timer skips a beat whenever it fires a hair under one interval after the last
        # one, so a live agent's heartbeats can be two intervals apart: with 2 attempts it was
        # dropped as dead (seen here), and the job restarted forever around it
        log.warning(
            "keep_alive_max_attempt raised to 3: fewer lets torch drop a live agent; the coordinator drops dead ones at once",
            extra={"asked": attempts},
        )
        attempts = _MIN_ATTEMPTS
    settings = RendezvousSettings(
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        timeout,
        keep_alive_interval=timedelta(seconds=params.get_as_int("keep_alive_interval", 5) or 5),
        keep_alive_max_attempt=attempts,
    )
    holder = _StateHolder(EtcdRendezvousBackend(etcd, params.run_id), settings, DeadPeers(etcd, params.run_id))
    store = EtcdStore(etcd, f"{RDZV_PREFIX}{params.run_id}/store")
    handler = FFPlaneRendezvousHandler(
        FFPlaneRendezvousHandler._node_desc_generator.generate(params.local_addr), settings, store, holder, node
    )
    log.info("ffplane rendezvous", extra={"run_id": params.run_id, "etcd": etcd.endpoints, "node": node})
    return handler


def torchrun_handler() -> Any:
    """The ``torchrun.handlers`` entry point: torch calls it for the creator of handlers."""
    return create_handler


__all__ = ["BACKEND", "DeadPeers", "EtcdRendezvousBackend", "EtcdStore", "FFPlaneRendezvousHandler", "create_handler"]
