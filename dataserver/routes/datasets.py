"""The datasets the server can plan over: their names, lengths and columns."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from dataserver.http_errors import documented
from dataserver.routes._common import PathName, Server
from ffplane_contract.errors import InvalidError, NotFoundError

router = APIRouter()


@router.get("/v1/datasets")
def list_datasets(server: Server) -> list[dict[str, Any]]:
    return [server.catalog.describe(name) for name in server.catalog.names()]


@router.get("/v1/datasets/{name}", responses=documented(NotFoundError, InvalidError))
def get_dataset(name: PathName, server: Server) -> dict[str, Any]:
    """The dataset's name, format, length and columns; 422 if it cannot be opened."""
    return server.catalog.get(name).describe()
