"""``statestore serve``: the node daemon. Its settings are ``DaemonConfig``'s declaration: the flags,
``$FFPLANE_STATESTORE_*`` and the ``[statestore.serve]`` table come from it (``ffplane_contract.settings``)."""

from __future__ import annotations

import os
import sys

from ffplane_contract.settings import Command, ConfigError, Program
from statestore.config import DaemonConfig

PROGRAM = Program("statestore", "ffplane node daemon", [Command("serve", DaemonConfig, "run the node daemon")])


def main(argv: list[str] | None = None) -> int:
    try:
        _, cfg = PROGRAM.parse(argv, os.environ)
    except ConfigError as exc:
        print(f"statestore: error: {exc}", file=sys.stderr)
        return 2
    assert isinstance(cfg, DaemonConfig)
    from ffplane_contract.auth import TOKEN_ENV, read_token
    from ffplane_contract.errors import UnauthorisedError
    from ffplane_runtime.httpserver import die_with_parent_if_asked, serve, setup_logging
    from statestore.app import create_app
    from statestore.daemon import Daemon
    from statestore.shm import ShmError

    die_with_parent_if_asked(os.environ)
    setup_logging(cfg.log_level, cfg.log_format, "statestore")
    try:
        cfg.resolve_addresses()
        cfg.check_root()
        token = read_token(cfg.token_file, os.environ.get(TOKEN_ENV))
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
