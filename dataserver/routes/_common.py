"""What every route module shares: the server as a dependency, the token and "coordinating
only" checks, and the bounded path and query parameters."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Path, Query, Request

from dataserver.server_state import DataServer
from ffplane_contract.limits import LAYOUT_LIMIT, MAX_COUNT, NAME_LEN, NAME_PATTERN, NODE_ID_PATTERN, STEP_LIMIT


# Dependencies are async: a sync one would cost each request a hop to the thread pool.
async def _server(request: Request) -> DataServer:
    server: DataServer = request.app.state.server
    return server


Server = Annotated[DataServer, Depends(_server)]


async def _token(request: Request, server: Server) -> None:
    await server.auth(request)


async def _coordinating(server: Server) -> None:
    server.coordination.check_leading()


TOKEN = [Depends(_token)]  # the body and its size are judged by BodyGuard before this
LEADER_ONLY = [Depends(_coordinating)]  # coordinator routes: the others say which server coordinates
SECURED: dict[str, Any] = {"security": [{"bearer": []}]}  # the token's scheme, in the OpenAPI document

PathName = Annotated[str, Path(min_length=1, max_length=NAME_LEN, pattern=NAME_PATTERN, description="a job or dataset name")]
NodeIdPath = Annotated[str, Path(min_length=1, max_length=NAME_LEN, pattern=NODE_ID_PATTERN)]
DpRank = Annotated[int, Query(ge=0, lt=LAYOUT_LIMIT)]
Step = Annotated[int, Query(ge=0, lt=STEP_LIMIT)]
Count = Annotated[int, Query(ge=1, le=MAX_COUNT)]
