"""The node daemon's one configuration object; ``statestore serve`` mirrors it flag for flag."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from statestore.link_gate import GateConfig

DEFAULT_ROOT = Path("/dev/shm/ffplane")
SOCKET_NAME = "daemon.sock"


@dataclass
class DaemonConfig:
    dataserver: str  # base URL of the job's data server, e.g. http://10.0.0.1:8470
    root: Path = DEFAULT_ROOT  # on tmpfs; data cache, slots and the LMDB index live here
    host: str = "127.0.0.1"  # ops HTTP
    port: int = 8471
    budget_bytes: int = 4 << 30  # shared memory this daemon may fill
    window: int = 4  # steps prefetched ahead of the slowest local reader of a dp rank
    keep_consumed: int = 2  # consumed steps kept for replay after a restore
    fetch_concurrency: int = 4  # HTTP fetches in flight across all dp ranks (4 measured best)
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

    @property
    def socket_path(self) -> Path:
        return self.root / SOCKET_NAME

    def __post_init__(self) -> None:
        if not self.node_id:
            import socket

            self.node_id = socket.gethostname()

    def validate(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.keep_consumed < 0:
            raise ValueError(f"keep_consumed must be >= 0, got {self.keep_consumed}")
        if self.fetch_concurrency < 1:
            raise ValueError(f"fetch_concurrency must be >= 1, got {self.fetch_concurrency}")
        if self.durable_every < 0 or (self.durable_every and self.durable_dir is None):
            raise ValueError("durable_every needs durable_dir and must be >= 0")
        self.gate.validate()
        if self.budget_bytes < 1 << 20:
            raise ValueError(f"budget_bytes must be >= 1 MiB, got {self.budget_bytes}")
