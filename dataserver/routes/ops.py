"""What operators and their tools read: liveness and readiness, Prometheus metrics, and the
status page (plain HTML polling ``/v1/cluster``)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Response
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dataserver.routes._common import Server
from dataserver.status_page import STATUS_PAGE
from ffplane_runtime.etcd import EtcdUnavailable

router = APIRouter()


@router.get("/v1/health")
@router.get("/healthz", include_in_schema=False)
async def health() -> dict[str, str]:
    """Liveness: the process serves HTTP."""
    return {"status": "ok"}


@router.get("/readyz", include_in_schema=False)
async def ready(server: Server) -> JSONResponse:
    """Readiness: the datasets folder is there and, with --etcd, the job records can be read."""
    why = None
    data_dir, etcd = server.config.data_dir, server.etcd
    if not data_dir.is_dir():
        why = f"--data-dir {data_dir} is not a directory"
    elif etcd is not None:
        try:
            await asyncio.to_thread(etcd.get, b"/ffplane/ready-probe", 0.0)
        except EtcdUnavailable as exc:
            why = f"etcd cannot be reached: {exc}"
    return JSONResponse({"status": "ready"} if why is None else {"detail": why}, status_code=200 if why is None else 503)


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
def status_page() -> HTMLResponse:
    """The status page: plain HTML and a little JS polling /v1/cluster (no CDN)."""
    return HTMLResponse(STATUS_PAGE)


@router.get("/metrics", response_class=PlainTextResponse, responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}}})
def prometheus(server: Server) -> Response:
    return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)
