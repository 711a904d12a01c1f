"""Probes and metrics: `/healthz` (the process answers) and `/readyz` (the database
answers and is migrated) need no key, so that an orchestrator can probe; `/metrics`
(Prometheus text format) needs the admin key or the service's metrics token, because
its figures name every tenant and job."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from marlaas.service.api.deps import AUTH_ERRORS, Context, MetricsReader

router = APIRouter(tags=["ops"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """Liveness: the process serves requests (answered on the event loop itself, so it
    fails when the loop is blocked)."""
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


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        **AUTH_ERRORS,
        200: {
            "description": "Prometheus metrics.",
            "content": {CONTENT_TYPE_LATEST.split(";")[0]: {}},
        },
    },
    dependencies=[MetricsReader],
)
async def metrics(ctx: Context) -> Response:
    """Prometheus metrics: jobs per tenant and status, request latencies, the pipeline's
    figures. Send the admin key or the metrics token (`MARLAAS_METRICS_TOKEN`)."""
    data = await asyncio.to_thread(generate_latest, ctx.registry)
    return Response(data, media_type=CONTENT_TYPE_LATEST)
