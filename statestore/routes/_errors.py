"""The daemon's HTTP errors: the shared classes of ``ffplane_contract.errors``, answered by one
handler as ``{"detail": message}`` at the class's status, and the statuses each route documents."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ffplane_contract.daemon_http import ErrorDetail, ValidationDetail
from ffplane_contract.errors import CapacityError, FFPlaneError

__all__ = ["answer_errors", "documented", "status_of"]

_WHY = {
    400: "the body does not fit the transfer (it runs past the shard's size)",
    401: "missing or wrong bearer token",
    404: "no such shard on this node",
    409: "the transfer is not in the state this request needs (not begun, already partly here, replaced meanwhile)",
    413: "the body, or the replica it announces, is larger than this daemon can keep (--budget-mb), or has room for now",
    416: "the byte range is outside the shard",
    422: "a parameter or the body is malformed, or a replica's bytes failed their checksum",
    503: "the daemon has no job token configured",
}


def status_of(exc: FFPlaneError) -> int:
    """An error's status on the HTTP API. No room *now* (``CapacityError``, 507 on the control
    socket, where a local save turns it into an error the worker sees) is a 413 here: the
    request is more than this daemon can take at the moment, the sender retries later, and no
    fault of the server is reported as a 5xx."""
    return 413 if exc.status == CapacityError.status else exc.status


async def _answer(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, FFPlaneError)
    return JSONResponse({"detail": str(exc)}, status_code=status_of(exc))


def answer_errors(app: FastAPI) -> None:
    """Answer every ``FFPlaneError`` a route raises (one that escapes the handler is a bug: 500)."""
    app.add_exception_handler(FFPlaneError, _answer)


def documented(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The error answers of a route, for its OpenAPI ``responses``."""
    return {c: {"model": ValidationDetail if c == 422 else ErrorDetail, "description": _WHY[c]} for c in codes}
