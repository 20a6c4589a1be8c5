"""Process plumbing shared by ffplane's servers: JSON log lines, bearer tokens, serving an app.

Both the data server and the node daemon run FastAPI on uvicorn the same way: bind first (so an
ephemeral port is known), publish ``{"host", "port", "pid"}`` to a ready file for whoever started
the process, then serve until SIGTERM/SIGINT with uvicorn's graceful shutdown.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import uvicorn
from fastapi import HTTPException, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DIE_WITH_PARENT_ENV = "FFPLANE_DIE_WITH_PARENT"


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: ISO time, level, component, logger, message and any ``extra=`` fields."""

    _std = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "color_message"}

    def __init__(self, component: str = "") -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": _iso(record.created),
            "level": record.levelname.lower(),
            "component": self.component,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        line.update(_extras(record, self._std))
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextLogFormatter(logging.Formatter):
    """For a person at a terminal: ``13:10:02.123 INFO  statestore  root ready  root=/dev/shm/ffplane``."""

    _std = JsonLogFormatter._std

    def __init__(self, component: str = "") -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        when = time.strftime("%H:%M:%S", time.localtime(record.created)) + f".{int(record.created * 1000) % 1000:03d}"
        fields = " ".join(f"{k}={v}" for k, v in _extras(record, self._std).items())
        line = f"{when} {record.levelname:<7} {self.component or record.name}  {record.getMessage()}" + (f"  {fields}" if fields else "")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _iso(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created * 1000) % 1000:03d}Z"


def _extras(record: logging.LogRecord, std: set[str]) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in std}


def die_with_parent_if_asked(environ: Mapping[str, str]) -> None:
    """With ``$FFPLANE_DIE_WITH_PARENT=1`` in ``environ`` (a server's ``main`` hands it its
    environment; test and benchmark launchers set it): SIGTERM this server when the process that
    started it dies, even by SIGKILL, so nothing is orphaned."""
    if environ.get(DIE_WITH_PARENT_ENV) != "1":
        return
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        raise SystemExit("parent exited before start-up")


def setup_logging(level: str = "info", fmt: str = "auto", component: str = "") -> None:
    """Log lines on stderr: ``fmt`` ``text`` (for a person), ``json`` (for a collector), or
    ``auto`` (text on a terminal, JSON otherwise); each line names ``component``."""
    if fmt == "auto":
        fmt = "text" if sys.stderr.isatty() else "json"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(TextLogFormatter(component) if fmt == "text" else JsonLogFormatter(component))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


_NO_TOKEN = "this server has no token configured; set FFPLANE_TOKEN"
_BAD_TOKEN = "missing or wrong bearer token: send 'Authorization: Bearer <job token>'"


class BearerAuth:
    """FastAPI dependency: 401 unless ``Authorization: Bearer <token>`` matches."""

    def __init__(self, token: str | None) -> None:
        self.token = token

    def refusal(self, header: str) -> tuple[int, str] | None:
        """``(status, detail)`` if an ``Authorization`` header of ``header`` is refused, else None."""
        if self.token is None:
            return 503, _NO_TOKEN
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), self.token.encode()):
            return 401, _BAD_TOKEN
        return None

    async def __call__(self, request: Request) -> None:  # async: no thread-pool hop per request
        refused = self.refusal(request.headers.get("authorization", ""))
        if refused is not None:
            status, detail = refused
            raise HTTPException(status, detail, headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)


_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


async def _reply(send: Send, status: int, detail: str, extra: Sequence[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"connection", b"close"), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodyGuard:
    """Pure ASGI middleware: a request that may carry a body (POST, PUT, PATCH, DELETE) is judged
    on its token and its declared size before anything reads it, and its body is read here,
    counted as it arrives (a chunked one too), and refused with 413 the moment it passes
    ``max_body_bytes``. FastAPI reads and parses a body before any dependency runs, so a
    dependency cannot do this: 300 MiB without a token were read into memory, and a chunked
    body declared no size to check. Every route that takes a body needs the token, so one
    without it is refused whatever its path. Refusals close the connection rather than read
    what the client still sends."""

    def __init__(self, app: ASGIApp, auth: BearerAuth, max_body_bytes: int) -> None:
        self.app, self.auth, self.max_body_bytes = app, auth, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        authorization, length = "", None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"content-length":
                length = value
        refused = self.auth.refusal(authorization)
        if refused is not None:
            status, detail = refused
            await _reply(send, status, detail, [(b"www-authenticate", b"Bearer")] if status == 401 else [])
            return
        limit = self.max_body_bytes
        if length is not None and (not length.isdigit() or int(length) > limit):
            await _reply(send, 413, f"request body of {length.decode('latin-1')} bytes exceeds the limit of {limit} bytes")
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _reply(send, 413, f"request body exceeds the limit of {limit} bytes (refused after {size} bytes had arrived)")
                return
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"cannot listen on {host}:{port}: {exc}") from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def write_ready_file(path: str | None, **info: Any) -> None:
    if not path:
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"pid": os.getpid(), "started": time.time(), **info}, f)
    os.replace(tmp, path)  # readers never see a half-written file


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_KEEP_HEAP_BYTES = 256 << 20
_MMAP_ABOVE_BYTES = 32 << 20


def keep_heap() -> None:
    """Let glibc keep freed memory for reuse instead of handing it back to the kernel.

    Both servers allocate and free a few MiB of buffers per 4 MiB step (socket reads, aiohttp's
    chunks, Arrow bodies). With glibc's defaults much of that came from fresh pages — chunks above
    its mmap threshold, or heap it had just trimmed — and each page's first touch faulted: 9 % of
    the daemon's CPU per cached step, the data server's too (``perf`` during
    ``bench/path_cpu.py``). Retained memory is bounded by the servers' peak of buffers in flight.
    A no-op off glibc.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, _MMAP_ABOVE_BYTES)
    mallopt(_M_TRIM_THRESHOLD, _KEEP_HEAP_BYTES)


def serve(app: Any, host: str, port: int, ready_file: str | None = None, on_bound: Any = None, **ready: Any) -> None:
    """Serve ``app`` until SIGTERM/SIGINT; the ready file names the bound port."""
    keep_heap()
    sock = bind(host, port)
    bound_port = sock.getsockname()[1]
    if on_bound is not None:
        on_bound(bound_port)
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    write_ready_file(ready_file, host=host, port=bound_port, **ready)
    logging.getLogger(__name__).info("listening", extra={"host": host, "port": bound_port})
    server.run(sockets=[sock])


def offline_docs(app: Any) -> None:
    """``/docs`` (Swagger UI) and ``/redoc`` from assets shipped with the package (fastapi-offline's
    copies), not a CDN: the pages work on a cluster with no way out. Create the app with
    ``docs_url=None, redoc_url=None``."""
    from pathlib import Path

    import fastapi_offline
    from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
    from fastapi.staticfiles import StaticFiles

    assets = Path(fastapi_offline.__file__).parent / "static"
    app.mount("/static/docs", StaticFiles(directory=assets), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    def swagger() -> Any:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url,
            title=f"{app.title} API",
            swagger_js_url="/static/docs/swagger-ui-bundle.js",
            swagger_css_url="/static/docs/swagger-ui.css",
            swagger_favicon_url="/static/docs/favicon.png",
        )

    @app.get("/redoc", include_in_schema=False)
    def redoc() -> Any:
        return get_redoc_html(
            openapi_url=app.openapi_url,
            title=f"{app.title} API",
            redoc_js_url="/static/docs/redoc.standalone.js",
            redoc_favicon_url="/static/docs/favicon.png",
            with_google_fonts=False,
        )
