"""Probes and metrics, unauthenticated: `/healthz` (the process answers), `/readyz` (the
database answers and is migrated), `/metrics` (Prometheus text format)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from marlaas.service.api.deps import Context

router = APIRouter(tags=["ops"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """Liveness: the process serves requests."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "The database is not ready."}})
async def readyz(ctx: Context) -> JSONResponse:
    """Readiness: the database answers and its schema is current. `backend` says
    whether jobs will actually run ("none": they stay queued)."""
    ok = await asyncio.to_thread(ctx.db.ping)
    body = {
        "status": "ready" if ok else "database unavailable or not migrated",
        "database": ctx.db.dialect,
        "backend": type(ctx.backend).__name__ if ctx.backend is not None else "none",
    }
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics", response_class=Response)
async def metrics(ctx: Context) -> Response:
    """Prometheus metrics: jobs per tenant and status, request latencies."""
    data = await asyncio.to_thread(generate_latest, ctx.registry)
    return Response(data, media_type=CONTENT_TYPE_LATEST)
