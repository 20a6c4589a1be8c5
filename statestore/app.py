"""The daemon's HTTP app, assembled: the ops and peer routers over the running ``Node``, one
error handler, and a lifespan that runs the ``Daemon`` for as long as the app serves."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from ffplane_contract.settings import version
from ffplane_runtime.httpserver import offline_docs
from statestore.daemon import Daemon, Node
from statestore.routes import NODE, answer_errors, ops_router, peer_router

__all__ = ["create_app"]


def create_app(daemon: Daemon) -> FastAPI:
    """The ops (read-only) and peer HTTP API of ``daemon``, whose root is open; the app's
    lifespan starts it (``Daemon.running``) and hands the running node to every request."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Node]]:
        async with daemon.running() as node:
            yield {NODE: node}

    app = FastAPI(title="ffplane statestore (ops, read-only)", version=version(), lifespan=lifespan, docs_url=None, redoc_url=None)
    offline_docs(app)
    answer_errors(app)
    app.include_router(ops_router)
    app.include_router(peer_router)
    return app
