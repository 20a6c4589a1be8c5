"""The data server's routes, one module per concern, each an ``APIRouter`` over the one
``DataServer`` (``dataserver.server_state``) it reaches through ``request.app.state``."""

from __future__ import annotations

from fastapi import APIRouter

from dataserver.routes import batches, cluster, datasets, jobs, ops

# In this order: a path of one module must not be shadowed by a pattern of an earlier one.
ROUTERS: tuple[APIRouter, ...] = (ops.router, datasets.router, jobs.router, batches.router, cluster.router)

__all__ = ["ROUTERS"]
