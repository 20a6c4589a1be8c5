"""``dataserver`` command line: ``ingest`` datasets, ``serve`` them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dataserver.config import ServeConfig
from ffplane_contract.limits import MAX_COUNT
from ffplane_contract.settings import (
    ConfigError,
    Number,
    command_parser,
    http_url,
    parse,
    port,
    port_or_off,
    positive_seconds,
    subcommand,
)
from ffplane_runtime.etcd import parse_endpoints

LOG_LEVELS = ["debug", "info", "warning", "error"]
_SHARD_MB = Number(int, 1, 1 << 20)
_STEPS_PER_REQUEST = Number(int, 1, MAX_COUNT)
_BYTES = Number(int, 1, 1 << 40)
_BODY_BYTES = Number(int, 1, 1 << 30)


def _parser() -> argparse.ArgumentParser:
    p = command_parser("dataserver", "ffplane data server")
    sub = p.add_subparsers(dest="command", required=True)

    ing = subcommand(sub, "ingest", "convert JSONL/JSONL.GZ/Parquet/Arrow sources into a served dataset")
    ing.add_argument("sources", nargs="+", type=Path, metavar="SRC", help="source files (JSONL, JSONL.GZ, Parquet, Arrow IPC)")
    ing.add_argument("--out", type=Path, required=True, help="new dataset directory (under serve's --data-dir)")
    ing.add_argument("--shard-mb", type=_SHARD_MB, default=256, help="target shard size in MiB")
    ing.add_argument("--binary-field", action="append", default=[], help="JSONL field holding base64 bytes (repeatable)")
    ing.add_argument("--list-int-type", choices=["int32", "int64"], default="int32", help="type of JSON integer lists (token ids)")
    ing.add_argument("--no-progress", action="store_true", help="no progress bar")

    srv = subcommand(sub, "serve", "serve datasets and jobs over HTTP")
    d = ServeConfig(data_dir=Path("."))
    srv.add_argument("--data-dir", type=Path, required=True, help="the folder of datasets (one sub-folder each, as ingest writes them)")
    srv.add_argument(
        "--host", default=d.host, help="address to listen on (0.0.0.0: every interface; then with --etcd also --advertise-url)"
    )
    srv.add_argument("--port", type=port, default=d.port, help="0 picks a free port (see --ready-file)")
    srv.add_argument("--state-dir", type=Path, default=None, help="job records (default <data-dir>/.ffplane-jobs)")
    srv.add_argument("--token-file", default=None, help="job bearer token (else $FFPLANE_TOKEN_FILE or $FFPLANE_TOKEN)")
    srv.add_argument("--ready-file", default=None, help="write {host,port,pid} JSON here once listening")
    srv.add_argument(
        "--max-steps-per-request", type=_STEPS_PER_REQUEST, default=d.max_steps_per_request, help="most steps one batch request may ask for"
    )
    srv.add_argument("--max-bytes-per-request", type=_BYTES, default=d.max_bytes_per_request, help="batch bytes (estimated from the dataset's size) one request may ask for; 413 above")  # fmt: skip
    srv.add_argument("--max-samples-per-step", type=_BYTES, default=d.max_samples_per_step, help="largest dp x batch_per_rank a job or generation may have")  # fmt: skip
    srv.add_argument("--max-body-bytes", type=_BODY_BYTES, default=d.max_body_bytes, help="largest request body (job, heartbeat); 413 above, before it is read")  # fmt: skip
    srv.add_argument("--dead-after-s", type=positive_seconds, default=d.dead_after_s, help="declare a node dead after this much silence")
    srv.add_argument("--forget-dead-after-s", type=positive_seconds, default=d.forget_dead_after_s, help="forget a dead node (and its shard inventory) after this long")  # fmt: skip
    srv.add_argument("--heartbeat-udp-port", type=port_or_off, default=d.heartbeat_udp_port, help="UDP port for node heartbeats on --host (0: any free port, told to daemons over HTTP; -1: HTTP heartbeats only)")  # fmt: skip
    srv.add_argument("--etcd", default=None, help="etcd members host:port[,host:port...]: job records live there, so several data servers serve the same jobs and one at a time coordinates (a lease); the nodes declared dead are published for torchrun's --rdzv-backend ffplane")  # fmt: skip
    srv.add_argument("--etcd-wait-s", type=positive_seconds, default=d.etcd_wait_s, help="with --etcd: how long the members may not answer at start; then the server refuses to start (exit 2), naming them")  # fmt: skip
    srv.add_argument("--advertise-url", type=http_url, default=None, help="the URL daemons and the other data servers reach this one at: the leader key (--etcd), /v1/leader, the status page (default http://HOST:PORT)")  # fmt: skip
    srv.add_argument("--log-level", default=d.log_level, choices=LOG_LEVELS, help="least severe log lines written")
    srv.add_argument("--log-format", default="auto", choices=["auto", "text", "json"], help="auto: text on a terminal, JSON lines otherwise")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(_parser(), argv)
    except ConfigError as exc:
        print(f"dataserver: error: {exc}", file=sys.stderr)
        return 2
    if args.command == "ingest":
        from dataserver.ingest import IngestConfig, IngestError, ingest

        cfg = IngestConfig(
            sources=args.sources,
            out=args.out,
            shard_bytes=args.shard_mb << 20,
            binary_fields=args.binary_field,
            list_int_type=args.list_int_type,
            progress=not args.no_progress,
        )
        try:
            manifest = ingest(cfg)
        except IngestError as exc:
            print(f"dataserver ingest: error: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {manifest['num_samples']} samples in {len(manifest['shards'])} shards to {args.out}")
        return 0

    from dataserver.app import create_app
    from ffplane_contract.auth import load_token
    from ffplane_contract.errors import UnauthorisedError
    from ffplane_runtime.httpserver import die_with_parent_if_asked, serve, setup_logging

    die_with_parent_if_asked()
    cfg_s = ServeConfig(
        data_dir=args.data_dir,
        host=args.host,
        port=args.port,
        state_dir=args.state_dir,
        token_file=args.token_file,
        ready_file=args.ready_file,
        max_steps_per_request=args.max_steps_per_request,
        max_bytes_per_request=args.max_bytes_per_request,
        max_samples_per_step=args.max_samples_per_step,
        max_body_bytes=args.max_body_bytes,
        dead_after_s=args.dead_after_s,
        forget_dead_after_s=args.forget_dead_after_s,
        heartbeat_udp_port=args.heartbeat_udp_port,
        etcd=args.etcd,
        etcd_wait_s=args.etcd_wait_s,
        advertise_url=args.advertise_url,
        log_level=args.log_level,
    )
    setup_logging(cfg_s.log_level, args.log_format, "dataserver")
    if cfg_s.etcd is not None:
        try:
            parse_endpoints(cfg_s.etcd)
        except ValueError as exc:
            print(f"dataserver serve: error: --etcd: {exc}", file=sys.stderr)
            return 2
        if cfg_s.host in ("0.0.0.0", "::", "") and not cfg_s.advertise_url:
            print(
                f"dataserver serve: error: --host {cfg_s.host} is no address others can reach; with --etcd pass --advertise-url "
                "http://THIS_HOST:PORT (the coordinator's address daemons are sent to)",
                file=sys.stderr,
            )
            return 2
    try:
        token = load_token(cfg_s.token_file)
    except UnauthorisedError as exc:
        print(f"dataserver serve: error: {exc}", file=sys.stderr)
        return 2
    if token is None:
        print("dataserver serve: error: no job token; set FFPLANE_TOKEN or pass --token-file", file=sys.stderr)
        return 2
    if not cfg_s.data_dir.is_dir():
        print(f"dataserver serve: error: --data-dir {cfg_s.data_dir} is not a directory", file=sys.stderr)
        return 2
    if cfg_s.etcd is not None and not _etcd_answers(cfg_s.etcd, cfg_s.etcd_wait_s):
        return 2
    if cfg_s.etcd is not None and (cfg_s.advertise_url or cfg_s.port) and _url_coordinated_elsewhere(cfg_s.etcd, cfg_s.url(cfg_s.port)):
        return 2
    app = create_app(cfg_s, token)
    serve(app, cfg_s.host, cfg_s.port, cfg_s.ready_file, on_bound=lambda port: setattr(cfg_s, "port", port))
    return 0


def _etcd_answers(endpoints: str, wait_s: float) -> bool:
    """Whether etcd answers a read within ``wait_s``; if not, says so in one line. The job records
    live there: a server that started without them would fail its first request, not its start."""
    from ffplane_runtime.etcd import Etcd, EtcdUnavailable

    try:
        Etcd(endpoints, retry_s=wait_s).get(b"/ffplane/ready-probe")
    except (EtcdUnavailable, ValueError) as exc:
        print(f"dataserver serve: error: --etcd {endpoints}: {exc}", file=sys.stderr)
        return False
    return True


def _url_coordinated_elsewhere(endpoints: str, url: str) -> bool:
    """Whether another live data server coordinates under this one's URL (the same
    --advertise-url given twice); if so, says so in one line. Waits up to the coordination lease's
    TTL for an earlier run of this server, killed, to let its lease run out. (With --port 0 and no
    --advertise-url the URL is known once bound: a twin found then keeps this one a follower.)"""
    from dataserver.leadership import twin_leads, twin_refusal
    from ffplane_runtime.etcd import Etcd, EtcdUnavailable

    try:
        taken = twin_leads(Etcd(endpoints), url)
    except (EtcdUnavailable, ValueError):
        return False  # etcd went away since it answered: the server starts and campaigns when it is back
    if taken:
        print(f"dataserver serve: error: {twin_refusal(url)}", file=sys.stderr)
    return taken


if __name__ == "__main__":
    sys.exit(main())
