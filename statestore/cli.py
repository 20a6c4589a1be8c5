"""``statestore serve``: the node daemon."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ffplane_contract.settings import (
    ConfigError,
    Number,
    command_parser,
    nonneg_int,
    nonneg_rate,
    nonneg_seconds,
    parse,
    port,
    port_or_off,
    positive_int,
    subcommand,
)
from statestore.config import DaemonConfig
from statestore.link_gate import GateConfig

LOG_LEVELS = ["debug", "info", "warning", "error"]
_BUDGET_MB = Number(int, 1, 1 << 30)
_FETCH_STEPS = Number(int, 1, 256)  # a data server's default --max-steps-per-request
_HEARTBEAT_S = Number(float, 0.05, 3600.0, unit="seconds")  # faster would flood the coordinator
_CHUNK_KB = Number(int, 4, 1 << 20)


def _parser() -> argparse.ArgumentParser:
    p = command_parser("statestore", "ffplane node daemon")
    sub = p.add_subparsers(dest="command", required=True)
    srv = subcommand(sub, "serve", "run the node daemon")
    d = DaemonConfig(dataserver="")
    srv.add_argument(
        "--dataserver",
        required=True,
        help="data server base URL, e.g. http://127.0.0.1:8470; several comma-separated (they share the batch fetches, one coordinates)",
    )
    srv.add_argument("--root", type=Path, default=d.root, help="tmpfs directory for caches, slots and the index")
    srv.add_argument("--allow-non-tmpfs", action="store_true", help="accept a --root that is not on tmpfs (slots would be written to disk: slow, and they survive reboots)")  # fmt: skip
    srv.add_argument("--host", default="", help="address the ops and peer HTTP API listens on (default: 127.0.0.1 when the data server is on loopback, else the advertised address)")  # fmt: skip
    srv.add_argument("--advertise-address", default="", help="address other nodes' daemons reach this one at (default: this host's address on the route to the data server; never loopback or 0.0.0.0 across hosts)")  # fmt: skip
    srv.add_argument("--port", type=port, default=d.port, help="ops HTTP port (0 picks one; see --ready-file)")
    srv.add_argument("--bulk-port", type=port_or_off, default=d.bulk_port, help="TCP port replica pushes from other daemons arrive on (0 picks one, which peers ask the HTTP API for; -1 = none: pushes come over HTTP)")  # fmt: skip
    srv.add_argument("--budget-mb", type=_BUDGET_MB, default=d.budget_bytes >> 20, help="shared memory this daemon may use")
    srv.add_argument("--window", type=positive_int, default=d.window, help="steps prefetched ahead per dp rank")
    srv.add_argument("--keep-consumed", type=nonneg_int, default=d.keep_consumed, help="consumed steps kept for replay")
    srv.add_argument("--fetch-concurrency", type=positive_int, default=d.fetch_concurrency, help="batch fetches from the data servers in flight at once")  # fmt: skip
    srv.add_argument("--fetch-steps", type=_FETCH_STEPS, default=d.fetch_steps, help="small steps (at most 256 KiB) a prefetch asks a data server for at once, one request split into one file per step (1 = a request per step)")  # fmt: skip
    srv.add_argument("--fetch-retry-s", type=nonneg_seconds, default=d.fetch_retry_s, help="how long a fetch a reader waits on is retried while no data server answers")  # fmt: skip
    srv.add_argument("--durable-dir", type=Path, default=None, help="directory of the durable tier (safetensors + JSON)")
    srv.add_argument("--durable-every", type=nonneg_int, default=d.durable_every, help="copy committed shards to --durable-dir every N steps (0 = off); copies are written behind the steps, so losing every copy in memory goes back up to 2N-1 steps")  # fmt: skip
    srv.add_argument("--node-id", default="", help="this node's name in the ring (default: host name)")
    srv.add_argument("--heartbeat-s", type=_HEARTBEAT_S, default=d.heartbeat_s, help="seconds between heartbeats to the coordinator")
    srv.add_argument("--no-replicate", action="store_true", help="do not push commits to the ring successor")
    srv.add_argument("--replica-max-lag", type=nonneg_int, default=d.replica_max_lag, help="a commit is answered once the ring successor holds the version this many commits back, counting itself (1 = itself); that push passes the link gate (0 = off: replication always waits for an idle link)")  # fmt: skip
    srv.add_argument("--replica-wait-s", type=nonneg_seconds, default=d.replica_wait_s, help="longest a commit answer waits for that replica (then logged)")  # fmt: skip
    g = d.gate
    srv.add_argument("--gate-rate-cap-mbit", type=nonneg_rate, default=0.0, help="cap on all STATE traffic, Mbit/s (0 = none)")
    srv.add_argument("--gate-iface", default=g.iface, help="training NIC whose byte counters close the gate (default: off)")
    srv.add_argument("--gate-link-mbit", type=nonneg_rate, default=0.0, help="that NIC's rate, Mbit/s")
    srv.add_argument("--gate-chunk-kb", type=_CHUNK_KB, default=g.chunk_bytes >> 10, help="STATE moves in chunks of this size")
    srv.add_argument("--no-gate", action="store_true", help="let STATE traffic through regardless of TRAIN (for baselines)")
    srv.add_argument("--token-file", default=None, help="job token (else $FFPLANE_TOKEN_FILE / $FFPLANE_TOKEN)")
    srv.add_argument("--ready-file", default=None, help="write {host, port, pid} JSON here once listening")
    srv.add_argument("--log-level", default=d.log_level, choices=LOG_LEVELS, help="least severe log lines written")
    srv.add_argument("--log-format", default="auto", choices=["auto", "text", "json"], help="auto: text on a terminal, JSON lines otherwise")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(_parser(), argv)
    except ConfigError as exc:
        print(f"statestore: error: {exc}", file=sys.stderr)
        return 2
    from ffplane_contract.auth import load_token
    from ffplane_contract.errors import UnauthorisedError
    from ffplane_runtime.httpserver import die_with_parent_if_asked, serve, setup_logging
    from statestore.app import create_app
    from statestore.daemon import Daemon
    from statestore.shm import ShmError

    cfg = DaemonConfig(
        dataserver=args.dataserver.rstrip("/"),
        root=args.root,
        host=args.host,
        advertise_address=args.advertise_address,
        port=args.port,
        bulk_port=args.bulk_port,
        budget_bytes=args.budget_mb << 20,
        window=args.window,
        keep_consumed=args.keep_consumed,
        fetch_concurrency=args.fetch_concurrency,
        fetch_steps=args.fetch_steps,
        fetch_retry_s=args.fetch_retry_s,
        durable_dir=args.durable_dir,
        durable_every=args.durable_every,
        node_id=args.node_id,
        heartbeat_s=args.heartbeat_s,
        replicate=not args.no_replicate,
        replica_max_lag=args.replica_max_lag,
        replica_wait_s=args.replica_wait_s,
        gate=GateConfig(
            rate_cap_bytes_s=args.gate_rate_cap_mbit * 1e6 / 8,
            iface=args.gate_iface,
            link_bytes_s=args.gate_link_mbit * 1e6 / 8,
            chunk_bytes=args.gate_chunk_kb << 10,
            enabled=not args.no_gate,
        ),
        token_file=args.token_file,
        ready_file=args.ready_file,
        log_level=args.log_level,
        allow_non_tmpfs=args.allow_non_tmpfs,
    )
    die_with_parent_if_asked()
    setup_logging(cfg.log_level, args.log_format, "statestore")
    try:
        cfg.resolve_addresses()
        cfg.check_root()
        token = load_token(cfg.token_file)
        if token is None:
            raise ValueError(
                "no job token: set FFPLANE_TOKEN or FFPLANE_TOKEN_FILE, or pass --token-file (the data server's token; "
                "without it every fetch and heartbeat would be refused)"
            )
        daemon = Daemon(cfg, token)  # opens the root: a refusal leaves it as it was
    except (ShmError, ValueError, UnauthorisedError) as exc:  # UnauthorisedError: the token file unreadable or empty
        print(f"statestore serve: error: {exc}", file=sys.stderr)
        return 2
    with daemon:  # closed however serving ends: a port that cannot be bound, a failed start, a signal
        serve(
            create_app(daemon),
            cfg.host,
            cfg.port,
            cfg.ready_file,
            on_bound=daemon.bound,
            socket=str(cfg.socket_path),
            root=str(cfg.root),
            node_id=cfg.node_id,
            advertise=cfg.advertise_address,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
