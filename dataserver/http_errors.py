"""How the data server answers an error: one handler, one body, statuses from one table.

Routes raise the shared errors of ``ffplane_contract.errors``; the status each answers with is
its class's (that module's table), the body is ``{"detail": message}`` (``ErrorDetail``), and a
``NotCoordinatorError`` names the server that coordinates in ``LEADER_HEADER``. FastAPI's own
refusals (a request that fails its schema, a body that is not UTF-8 JSON) are put in the same
words and answered the same way. ``documented`` lists a route's errors in the OpenAPI document,
each described by its class.
"""

from __future__ import annotations

import inspect
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ffplane_contract.dataserver_http import ErrorDetail
from ffplane_contract.errors import FFPlaneError, InvalidError, NotCoordinatorError, UnavailableError
from ffplane_contract.servers import LEADER_HEADER
from ffplane_runtime.etcd import EtcdUnavailable

# The statuses a class answers with besides its own, over this server's HTTP.
TOO_LARGE = 413  # a CapacityError: more than one request may carry or ask for
PAST_THE_END = 416  # a NotFoundError: a step or dp rank outside the job's plan
NOT_JSON = 415  # an InvalidError: a body not sent as application/json

Documented = type[FFPlaneError] | tuple[type[FFPlaneError], int]


def documented(*errors: Documented) -> dict[int | str, dict[str, Any]]:
    """The ``responses`` of a route that answers ``errors``: each a class (at its status) or a
    ``(class, status)`` pair, described by the first paragraph of the class's docstring."""
    out: dict[int | str, dict[str, Any]] = {}
    for error in errors:
        cls, status = error if isinstance(error, tuple) else (error, error.status)
        what = inspect.cleandoc(cls.__doc__ or cls.__name__).split("\n\n")[0]
        out[status] = {"model": ErrorDetail, "description": " ".join(what.split())}
    return out


def answer(exc: FFPlaneError) -> JSONResponse:
    """The one answer to an error: its class's status, ``{"detail": message}``, and for a
    NotCoordinatorError the coordinating server's URL (empty while none coordinates)."""
    headers = {LEADER_HEADER: exc.leader or ""} if isinstance(exc, NotCoordinatorError) else None
    return JSONResponse({"detail": str(exc)}, status_code=exc.status, headers=headers)


async def _ffplane_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, FFPlaneError)
    if isinstance(exc, EtcdUnavailable):  # job records live in etcd (--etcd): none can be read or recorded
        exc = UnavailableError(f"job records cannot be reached: {exc}")
    return answer(exc)


async def _invalid_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    kind = request.headers.get("content-type", "")
    if request.method in ("POST", "PUT") and not kind.startswith("application/json"):
        # curl -d sends a form content type; the JSON body was never read as JSON
        return answer(
            InvalidError(
                f"the body must be JSON sent with Content-Type: application/json (got {kind or 'none'!r}; "
                "curl: -H 'Content-Type: application/json')",
                NOT_JSON,
            )
        )
    return answer(InvalidError(_validation_detail(exc)))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 400:  # FastAPI's answer to a body it cannot decode (not UTF-8)
        return answer(InvalidError("the body could not be decoded: send a UTF-8 JSON object"))
    return await http_exception_handler(request, exc)  # an unknown path, a token refused (BearerAuth)


def _validation_detail(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:8]:
        loc = ".".join(str(x) for x in err.get("loc", ()))
        if err.get("type") == "string_pattern_mismatch":
            parts.append(f"{loc}: {str(err.get('input'))[:140]!r} must match {err.get('ctx', {}).get('pattern')}")
        else:
            parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(FFPlaneError, _ffplane_error)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(StarletteHTTPException, _http_error)
