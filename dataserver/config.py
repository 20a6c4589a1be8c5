"""The data server's one configuration object; ``dataserver serve`` mirrors it flag for flag."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class ServeConfig:
    data_dir: Path  # one sub-folder per dataset (ffplane Arrow dataset or LMDB environment)
    host: str = "127.0.0.1"
    port: int = 8470
    state_dir: Path | None = None  # job records; default <data_dir>/.ffplane-jobs
    token_file: str | None = None  # else $FFPLANE_TOKEN_FILE / $FFPLANE_TOKEN
    ready_file: str | None = None  # JSON {"host","port","pid"} written once listening
    max_steps_per_request: int = 256
    max_bytes_per_request: int = 256 << 20  # estimated batch bytes one request may ask for (so one step too)
    max_samples_per_step: int = 1 << 24  # dp x batch_per_rank of any job or generation
    max_body_bytes: int = 16 << 20  # JSON bodies (jobs, heartbeats with inventories); checked before reading
    dead_after_s: float = 1.5  # a node silent this long is declared dead
    forget_dead_after_s: float = 600.0  # a dead node is forgotten (with its inventory) after this long
    sweep_s: float = 0.2  # how often silence is checked
    heartbeat_udp_port: int = 0  # UDP heartbeats (daemons learn it from their HTTP heartbeat); 0 any free port, -1 off
    etcd: str | None = None  # etcd members (host:port,...): job records, coordination lease, dead nodes for the rendezvous
    etcd_wait_s: float = 10.0  # how long etcd may not answer at start before the server refuses to start
    advertise_url: str | None = None  # how daemons and other data servers reach this one; default http://HOST:PORT
    log_level: str = "info"

    def url(self, port: int) -> str:
        """This server's URL as the leader key names it (``port``: the one bound, for --port 0)."""
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{port}"

    def resolved_state_dir(self) -> Path:
        return self.state_dir or self.data_dir / ".ffplane-jobs"
