"""The data server's HTTP API (FastAPI): datasets, jobs, plans, the batch stream, and the
coordinator's routes, assembled over one ``DataServer``.

Every integer a client sends has a bound in the schema and every name a length (and a pattern),
integers are strict (``true`` is not 1), and each route documents the 4xx codes it answers, all
with a ``{"detail": str}`` body that says what to change (``http_errors``). Requests that carry a
body are judged on their token and size before the body is read (``httpserver.BodyGuard``).
The routes live in ``dataserver.routes``, one module per concern; the bodies they take and
answer in ``ffplane_contract.dataserver_http``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from dataserver.config import ServeConfig
from dataserver.http_errors import add_error_handlers
from dataserver.routes import ROUTERS
from dataserver.server_state import DataServer
from ffplane_contract.settings import version
from ffplane_runtime.httpserver import BodyGuard, offline_docs


def create_app(config: ServeConfig, token: str | None) -> FastAPI:
    """The data server app; ``token``: the job's, read by the entry point (``dataserver serve``)."""
    server = DataServer(config, token)
    app = FastAPI(title="ffplane dataserver", version=version(), lifespan=_lifespan, docs_url=None, redoc_url=None)
    app.state.server = server
    offline_docs(app)
    add_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    app.add_middleware(BodyGuard, auth=server.auth, max_body_bytes=config.max_body_bytes)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    server: DataServer = app.state.server
    async with server.running():
        yield


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, with the bearer scheme the secured routes name (``SECURED``)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schema.setdefault("components", {})["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer", "description": "the job token ($FFPLANE_TOKEN)"}
        }
        app.openapi_schema = schema
    return app.openapi_schema
