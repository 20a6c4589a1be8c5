"""How a route reaches the running daemon: the app's lifespan hands every request the ``Node``
under ``NODE`` (Starlette's lifespan state), and the routes ask for it as a dependency."""

from __future__ import annotations

from typing import Annotated, cast

from fastapi import Depends, Request

from ffplane_runtime.httpserver import BearerAuth
from statestore.daemon import Node

__all__ = ["NODE", "NodeDep", "authorised", "node"]

NODE = "node"


async def node(request: Request) -> Node:
    return cast(Node, getattr(request.state, NODE))


NodeDep = Annotated[Node, Depends(node)]


async def authorised(request: Request) -> None:
    """401 (503 with no token configured) unless the request carries the job's token."""
    await BearerAuth((await node(request)).token)(request)
