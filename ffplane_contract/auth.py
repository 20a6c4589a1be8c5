"""How ffplane processes prove they belong to the job: one bearer token per job.

Every HTTP request between ffplane processes carries ``Authorization: Bearer <token>``; the UDP
heartbeats carry an HMAC keyed with the same token. A process finds the token in the file
``$FFPLANE_TOKEN_FILE`` names, else in ``$FFPLANE_TOKEN``: the commands' ``main`` reads those
variables and calls ``read_token``; ``load_token`` is the client library's documented default
(``DataLoader``, ``Jobs`` and the ``Checkpointer`` without a ``token=``), its one reader of them.
"""

from __future__ import annotations

import os
from pathlib import Path

from ffplane_contract.errors import UnauthorisedError

TOKEN_ENV = "FFPLANE_TOKEN"
TOKEN_FILE_ENV = "FFPLANE_TOKEN_FILE"
HEADER = "Authorization"


def bearer(token: str | None) -> dict[str, str]:
    """The request headers that carry ``token`` (none without one)."""
    return {HEADER: f"Bearer {token}"} if token else {}


def load_token(token_file: str | None = None) -> str | None:
    """The job's bearer token: ``token_file``, else ``$FFPLANE_TOKEN_FILE``, else ``$FFPLANE_TOKEN``
    (None without any); see ``read_token``."""
    return read_token(token_file or os.environ.get(TOKEN_FILE_ENV), os.environ.get(TOKEN_ENV))


def read_token(path: str | None, token: str | None) -> str | None:
    """The token in the file ``path``, else ``token`` (None without either). A token file that
    cannot be read or is empty raises ``UnauthorisedError``: the library's callers (``DataLoader``,
    ``Jobs``) raise it on, and the commands print it as their one-line refusal."""
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise UnauthorisedError(f"cannot read the token file {path}: {exc}") from exc
        if not token:
            raise UnauthorisedError(f"the token file {path} is empty")
        return token
    return token or None
