"""The node daemon's one configuration object; ``statestore serve`` mirrors it flag for flag."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from ffplane_contract.files import DEFAULT_ROOT, SOCKET_NAME
from ffplane_contract.servers import parse_urls
from statestore.link_gate import GateConfig

_MAX_FETCH_STEPS = 256


@dataclass
class DaemonConfig:
    dataserver: str  # base URL of the job's data server, e.g. http://10.0.0.1:8470; several comma-separated
    root: Path = DEFAULT_ROOT  # on tmpfs; data cache, slots and the LMDB index live here
    host: str = ""  # ops and peer HTTP; default: 127.0.0.1 if the data server is on loopback, else the advertised address
    advertise_address: str = ""  # where peers reach this daemon; default: this host's address on the route to the data server
    port: int = 8471
    bulk_port: int = 0  # replica pushes (TCP, on --host); 0 picks one (peers ask for it), -1 = none (pushes over HTTP)
    budget_bytes: int = 4 << 30  # shared memory this daemon may fill
    window: int = 4  # steps prefetched ahead of the slowest local reader of a dp rank
    keep_consumed: int = 2  # consumed steps kept for replay after a restore
    fetch_concurrency: int = 4  # HTTP fetches in flight across all dp ranks (4 measured best)
    fetch_steps: int = 16  # small steps (≤ 256 KiB: tokens) prefetched this many per request, split into files here; 1 = one each
    fetch_retry_s: float = 30.0  # how long a waiting reader's fetch is retried on 5xx/unreachable
    durable_dir: Path | None = None  # durable tier (safetensors + JSON), off unless set
    durable_every: int = 0  # copy committed shards there every N steps; 0 = off
    node_id: str = ""  # this node's name in the ring; default: the host name
    heartbeat_s: float = 1.0  # coordinator heartbeat period
    replicate: bool = True  # push every commit to the ring successor
    replica_max_lag: int = 1  # a commit is answered once the successor holds the version this many commits back, counting itself; 0 = off
    replica_wait_s: float = 30.0  # longest a commit answer waits for that replica
    gate: GateConfig = field(default_factory=GateConfig)  # when STATE may use the network
    token_file: str | None = None  # else $FFPLANE_TOKEN_FILE / $FFPLANE_TOKEN
    ready_file: str | None = None
    log_level: str = "info"
    allow_non_tmpfs: bool = False  # slots on a disk: slow, and they outlive a reboot the job does not

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

    def __post_init__(self) -> None:
        if not self.node_id:
            self.node_id = socket.gethostname()

    def validate(self) -> None:
        parse_urls(self.dataserver)  # ValueError naming an entry that is no URL
        for name, least in (("window", 1), ("keep_consumed", 0), ("fetch_concurrency", 1), ("fetch_steps", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")
        if self.fetch_steps > _MAX_FETCH_STEPS:  # a data server refuses more per request (its --max-steps-per-request)
            raise ValueError(
                f"fetch_steps must be <= {_MAX_FETCH_STEPS} (a data server's default --max-steps-per-request), got {self.fetch_steps}"
            )
        if self.durable_every < 0 or (self.durable_every and self.durable_dir is None):
            raise ValueError("durable_every needs durable_dir and must be >= 0")
        self.gate.validate()
        if self.budget_bytes < 1 << 20:
            raise ValueError(f"budget_bytes must be >= 1 MiB, got {self.budget_bytes}")


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
