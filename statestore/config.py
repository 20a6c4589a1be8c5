"""The node daemon's one configuration object: each setting declared once (type, default, range,
help); ``statestore serve``'s flags, ``$FFPLANE_STATESTORE_*`` variables, ``[statestore.serve]``
file keys and ``--help`` are derived from it (``ffplane_contract.settings``)."""

from __future__ import annotations

import ipaddress
import socket
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, model_validator

from ffplane_contract.files import DEFAULT_ROOT, SOCKET_NAME, SOCKET_PATH_MAX
from ffplane_contract.limits import DEFAULT_STEPS_PER_REQUEST
from ffplane_contract.servers import parse_urls
from ffplane_contract.settings import (
    LogFormat,
    LogLevel,
    NonNegInt,
    NonNegSeconds,
    Port,
    PortOrOff,
    PositiveInt,
    PositiveSeconds,
    RateMbit,
    Settings,
    Unit,
)
from ffplane_contract.warm import default_dir
from statestore.link_gate import GateConfig
from statestore.retention import DEFAULT_VERSIONS, MAX_PARITY_K, MAX_VERSIONS, MIN_VERSIONS


def _versions(n: int) -> int:
    if n < MIN_VERSIONS:
        raise ValueError(
            f"--versions {n} cannot survive a node loss: a node lost while its push is in flight leaves its roles no "
            f"intact copy in memory (its only replica half-overwritten); at least {MIN_VERSIONS}"
        )
    return n


def _parity_k(k: int) -> int:
    if k == 1:
        raise ValueError("--parity-k 1 is a whole replica of each shard: leave it at 0 (the default), or 2 and more for parity")
    if k < 0:
        raise ValueError(f"--parity-k is 0 (off) or 2..{MAX_PARITY_K}, got {k}")
    return k


def _urls(spec: str) -> str:
    return ",".join(parse_urls(spec))  # ValueError naming an entry that is no URL


class DaemonConfig(Settings):
    """``statestore serve``: one field per flag, in ``--help``'s order."""

    dataserver: Annotated[str, AfterValidator(_urls)] = Field(description="data server base URL, e.g. http://127.0.0.1:8470; several comma-separated (they share the batch fetches, one coordinates)")  # fmt: skip
    root: Path = Field(DEFAULT_ROOT, description="tmpfs directory for caches, slots and the index")
    allow_non_tmpfs: bool = Field(False, description="accept a --root that is not on tmpfs (slots would be written to disk: slow, and they survive reboots)")  # fmt: skip
    host: str = Field("", description="address the ops and peer HTTP API listens on (default: 127.0.0.1 when the data server is on loopback, else the advertised address)")  # fmt: skip
    advertise_address: str = Field("", description="address other nodes' daemons reach this one at (default: this host's address on the route to the data server; never loopback or 0.0.0.0 across hosts)")  # fmt: skip
    port: Port = Field(8471, description="ops HTTP port (0 picks one; see --ready-file)")
    bulk_port: PortOrOff = Field(0, description="TCP port replica pushes from other daemons arrive on (0 picks one, which peers ask the HTTP API for; -1 = none: pushes come over HTTP)")  # fmt: skip
    budget_mb: int = Field(4096, ge=1, le=1 << 30, description="shared memory this daemon may use, MiB")
    window: PositiveInt = Field(4, description="steps prefetched ahead of the slowest local reader of a dp rank")
    keep_consumed: NonNegInt = Field(2, description="consumed steps kept for replay after a restore")
    fetch_concurrency: PositiveInt = Field(4, description="batch fetches from the data servers in flight at once (4 measured best)")  # fmt: skip
    fetch_steps: int = Field(16, ge=1, le=DEFAULT_STEPS_PER_REQUEST, description="small steps (at most 256 KiB) a prefetch asks a data server for at once, one request split into one file per step (1 = a request per step; at most a data server's default --max-steps-per-request)")  # fmt: skip
    fetch_retry_s: NonNegSeconds = Field(30.0, description="how long a fetch a reader waits on is retried while no data server answers")  # fmt: skip
    fetch_read_timeout_s: PositiveSeconds = Field(10.0, description="a data server that sends nothing on a fetch for this long is passed over (the fetch goes to the next one, or is retried); raise it for servers slow to start a large batch")  # fmt: skip
    durable_dir: Path | None = Field(None, description="directory of the durable tier (safetensors + JSON)")
    durable_every: NonNegInt = Field(0, description="copy committed shards to --durable-dir every N steps (0 = off); copies are written behind the steps, so losing every copy in memory goes back up to 2N-1 steps")  # fmt: skip
    node_id: str = Field("", description="this node's name in the ring (default: host name)")
    heartbeat_s: Annotated[float, Unit("seconds")] = Field(1.0, ge=0.05, le=3600.0, description="seconds between heartbeats to the coordinator (faster would flood it)")  # fmt: skip
    no_replicate: bool = Field(False, description="do not push commits to the ring successor")
    replica_max_lag: NonNegInt = Field(1, description="a commit is answered once the ring successor holds the version this many commits back, counting itself (1 = itself); that push passes the link gate (0 = off: replication always waits for an idle link)")  # fmt: skip
    replica_wait_s: NonNegSeconds = Field(30.0, description="longest a commit answer waits for that replica (then logged)")
    parity_k: Annotated[int, AfterValidator(_parity_k)] = Field(0, le=MAX_PARITY_K, description="parity replicas: each group of this many nodes (in node-id order) keeps the XOR of its shards on the node after it, instead of a whole copy on each successor: versions x (1 + 1/k) the shard per role, a lost node rebuilt from its group (k shards moved to restore it); pushes then come over HTTP (0 = off: whole replicas)")  # fmt: skip
    versions: Annotated[int, AfterValidator(_versions)] = Field(DEFAULT_VERSIONS, le=MAX_VERSIONS, description=f"committed versions each local role keeps here, in as many slots, and its ring successor in replica files (at least {MIN_VERSIONS}): 2 survive a worker kill, a daemon kill and one node loss losing at most one step when saves are settled (trainer_client.settle_all, which the DDP comm hook calls); a role whose saves are not is given a slot and a file more, and may lose two")  # fmt: skip
    gate_rate_cap_mbit: RateMbit = Field(0.0, description="cap on all STATE traffic, Mbit/s (0 = none)")
    gate_iface: str = Field("", description="training NIC whose byte counters close the gate (default: off)")
    gate_link_mbit: RateMbit = Field(0.0, description="that NIC's rate, Mbit/s")
    gate_chunk_kb: int = Field(GateConfig.chunk_bytes >> 10, ge=4, le=1 << 20, description="STATE moves in chunks of this size, KiB")
    no_gate: bool = Field(False, description="let STATE traffic through regardless of TRAIN (for baselines)")
    warm_dir: Path = Field(default_factory=default_dir, description="the warm-start zygotes' folder whose readiness /v1/state shows (the workers' $FFPLANE_WARM_DIR; default /dev/shm/ffplane-warm-<uid>)")  # fmt: skip
    token_file: str | None = Field(None, description="job token (else $FFPLANE_TOKEN_FILE / $FFPLANE_TOKEN)")
    ready_file: str | None = Field(None, description="write {host, port, pid} JSON here once listening")
    log_level: LogLevel = Field("info", description="least severe log lines written")
    log_format: LogFormat = Field("auto", description="auto: text on a terminal, JSON lines otherwise")

    def model_post_init(self, context: Any, /) -> None:
        if not self.node_id:
            self.node_id = socket.gethostname()

    @model_validator(mode="after")
    def _across_settings(self) -> DaemonConfig:
        if self.durable_every and self.durable_dir is None:
            raise ValueError("--durable-every needs --durable-dir")
        self.gate.validate()  # an --gate-iface needs its --gate-link-mbit
        if len(bytes(self.socket_path)) > SOCKET_PATH_MAX:  # else a traceback from bind() at startup
            raise ValueError(f"--root is too long: its control socket {self.socket_path} would be over {SOCKET_PATH_MAX} bytes")
        return self

    @property
    def budget_bytes(self) -> int:
        return self.budget_mb << 20

    @property
    def replicate(self) -> bool:
        return not self.no_replicate

    @cached_property
    def gate(self) -> GateConfig:
        """When STATE may use the network."""
        return GateConfig(
            rate_cap_bytes_s=self.gate_rate_cap_mbit * 1e6 / 8,
            iface=self.gate_iface,
            link_bytes_s=self.gate_link_mbit * 1e6 / 8,
            chunk_bytes=self.gate_chunk_kb << 10,
            enabled=not self.no_gate,
        )

    def validate(self) -> None:  # type: ignore[override]  # pydantic's deprecated classmethod of that name
        """Check the settings again (the declaration's ranges; ValueError naming the first that
        fails): a config built, then changed in code."""
        type(self).model_validate(self.model_dump())

    def check_root(self) -> None:
        """Refuse a root that is not on tmpfs (unless allowed): slots there go to disk."""
        from statestore.shm import filesystem

        fs_type = filesystem(self.root)[0]
        if fs_type != "tmpfs" and not self.allow_non_tmpfs:
            raise ValueError(
                f"--root {self.root} is on {fs_type}, not tmpfs: every save would be written to disk. Use a tmpfs (e.g. "
                "/dev/shm/ffplane, or a tmpfs mounted huge=within_size: docs/deployment.md), or pass --allow-non-tmpfs"
            )

    def resolve_addresses(self) -> None:
        """Fill ``host`` and ``advertise_address``, or refuse a pair peers could not use. A daemon
        that advertised loopback or 0.0.0.0 got its own replicas back: a node loss then lost them."""
        where = urlsplit(parse_urls(self.dataserver)[0]).hostname or ""
        local_ds = _loopback(where)
        if self.advertise_address and (_unspecified(self.advertise_address) or (_loopback(self.advertise_address) and not local_ds)):
            raise ValueError(
                f"--advertise-address {self.advertise_address} cannot be reached by other hosts; give this host's address on the "
                "training network (or leave it out: the address on the route to the data server is used)"
            )
        if not self.advertise_address:
            specific = self.host and not _unspecified(self.host) and not _loopback(self.host)
            self.advertise_address = self.host if specific else _route_to(where)
        if not self.host:
            self.host = "127.0.0.1" if _loopback(self.advertise_address) else self.advertise_address
        if _loopback(self.host) and not _loopback(self.advertise_address):
            raise ValueError(
                f"the daemon would listen on {self.host} only, but its peers reach it at {self.advertise_address}: "
                f"pass --host {self.advertise_address} (or leave --host out)"
            )
        if _loopback(self.advertise_address) and not local_ds:
            raise ValueError(
                f"the data server {self.dataserver} is on another host, but this daemon would advertise {self.advertise_address}, "
                "which only this host can reach: pass --advertise-address with this host's address on the training network"
            )

    @property
    def advertised_url(self) -> str:
        host = self.advertise_address
        return f"[{host}]" if ":" in host else host

    @property
    def socket_path(self) -> Path:
        return self.root / SOCKET_NAME


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _route_to(host: str) -> str:
    """This host's address on the route to ``host`` (a UDP connect sends nothing)."""
    if _loopback(host):
        return "127.0.0.1"
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(addr)
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise ValueError(
            f"cannot find this host's address on the route to the data server {host!r} ({exc}); pass --advertise-address"
        ) from exc
