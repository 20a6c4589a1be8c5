"""``dataserver`` command line: ``ingest`` datasets, ``serve`` them. The settings of each are a
declaration in ``dataserver.config``; flags, ``$FFPLANE_DATASERVER_*`` and the ``[dataserver.*]``
tables come from it (``ffplane_contract.settings``)."""

from __future__ import annotations

import os
import sys

from dataserver.config import IngestOptions, ServeConfig
from ffplane_contract.settings import Command, ConfigError, Program

PROGRAM = Program(
    "dataserver",
    "ffplane data server",
    [
        Command("ingest", IngestOptions, "convert JSONL/JSONL.GZ/Parquet/Arrow sources into a served dataset"),
        Command("serve", ServeConfig, "serve datasets and jobs over HTTP"),
    ],
)


def main(argv: list[str] | None = None) -> int:
    try:
        command, cfg = PROGRAM.parse(argv, os.environ)
    except ConfigError as exc:
        print(f"dataserver: error: {exc}", file=sys.stderr)
        return 2
    if command == "ingest":
        return _ingest(cfg)
    return _serve(cfg)


def _ingest(options: IngestOptions) -> int:
    from dataserver.ingest import IngestError, ingest

    try:
        manifest = ingest(options.to_config())
    except IngestError as exc:
        print(f"dataserver ingest: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {manifest['num_samples']} samples in {len(manifest['shards'])} shards to {options.out}")
    return 0


def _serve(cfg: ServeConfig) -> int:
    from dataserver.app import create_app
    from ffplane_contract.auth import TOKEN_ENV, read_token
    from ffplane_contract.errors import UnauthorisedError
    from ffplane_runtime.httpserver import die_with_parent_if_asked, serve, setup_logging

    die_with_parent_if_asked(os.environ)
    setup_logging(cfg.log_level, cfg.log_format, "dataserver")
    try:
        token = read_token(cfg.token_file, os.environ.get(TOKEN_ENV))
    except UnauthorisedError as exc:
        print(f"dataserver serve: error: {exc}", file=sys.stderr)
        return 2
    if token is None:
        print("dataserver serve: error: no job token; set FFPLANE_TOKEN or pass --token-file", file=sys.stderr)
        return 2
    if not cfg.data_dir.is_dir():
        print(f"dataserver serve: error: --data-dir {cfg.data_dir} is not a directory", file=sys.stderr)
        return 2
    if cfg.etcd is not None and not _etcd_answers(cfg.etcd, cfg.etcd_wait_s):
        return 2
    if cfg.etcd is not None and (cfg.advertise_url or cfg.port) and _url_coordinated_elsewhere(cfg.etcd, cfg.url(cfg.port)):
        return 2
    app = create_app(cfg, token)
    serve(app, cfg.host, cfg.port, cfg.ready_file, on_bound=lambda port: setattr(cfg, "port", port))
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
