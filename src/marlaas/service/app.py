"""The FastAPI app: `open_context` builds the service's state (database migrated, admin
key ensured, files of deleted jobs removed), `create_app` wires routes, middleware, error answers and the backend.

Shutdown order (the lifespan's end): the Tinker API's hub first (its own device, if
it opened one), then the backend (it checkpoints and stops its jobs, reporting through
the still-open database), for at most `shutdown_timeout_s`, then the database pool. `marlaas serve` gives open requests
`GRACEFUL_SHUTDOWN_S` before that, so SIGTERM ends the process within 10 s whatever
runs (past the backend's time, a job resumes from its previous checkpoint, as after
a crash: checkpoints are written atomically).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from marlaas import __version__
from marlaas.service import openai_api, openai_ft, tinker, web
from marlaas.service.admission import JobAdmission
from marlaas.service.api import admin, datasets, jobs, ops, usage
from marlaas.service.auth import PrincipalCache, bootstrap_admin_key
from marlaas.service.backend import BackendFactory
from marlaas.service.context import ServiceContext
from marlaas.service.db import Database
from marlaas.service.deletion import purge_deleted_jobs
from marlaas.service.errors import InvalidField, ServiceError
from marlaas.service.metrics import PipelineMetrics, make_registry
from marlaas.service.middleware import AllowedMethods, BodyLimit, RequestTimer
from marlaas.service.reporter import JobReporter
from marlaas.service.settings import ServiceSettings

log = logging.getLogger(__name__)

#: Seconds uvicorn lets open requests finish at shutdown before it cancels them.
GRACEFUL_SHUTDOWN_S = 3


def open_context(settings: ServiceSettings) -> tuple[ServiceContext, str | None]:
    """The service's state, ready to serve, and the admin key if one was just generated
    (the caller shows it once; only its hash is stored)."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    settings.artifact_dir.mkdir(parents=True, exist_ok=True)
    db = Database(settings.database_url)
    with db.transaction() as session:
        new_admin_key = bootstrap_admin_key(session, settings.admin_key)
    # Files that deleted jobs left behind (a crash between a delete and its removal).
    try:
        purge_deleted_jobs(db, settings.artifact_dir)
    except OSError:
        log.exception("could not remove deleted jobs' files; the next delete retries")
    registry, request_metrics = make_registry(db)
    ctx = ServiceContext(
        settings=settings,
        db=db,
        reporter=JobReporter(db, settings.artifact_dir, on_done=(openai_ft.write_results,)),
        registry=registry,
        request_metrics=request_metrics,
        admission=JobAdmission(settings),
        principals=PrincipalCache(settings.auth_cache_s),
    )
    registry.register(PipelineMetrics(lambda: ctx.backend, db))
    return ctx, new_admin_key


async def _service_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServiceError)
    if isinstance(exc, InvalidField):
        detail = [{"loc": list(exc.loc), "msg": exc.message, "type": "value_error"}]
        return JSONResponse({"detail": detail}, status_code=422)
    headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
    return JSONResponse({"detail": str(exc)}, status_code=exc.status_code, headers=headers)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    """Field-level 422: where (`loc`) and what (`msg`) for each problem, without echoing
    the submitted values back."""
    assert isinstance(exc, RequestValidationError)
    detail = [
        {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
        for e in exc.errors()
    ]
    return JSONResponse({"detail": detail}, status_code=422)


def create_app(ctx: ServiceContext, backend_factory: BackendFactory | None = None) -> FastAPI:
    """The app over `ctx`. `backend_factory` builds the job backend when the app starts;
    None: jobs are accepted and stay queued (said once in the log)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if backend_factory is None:
            log.warning(
                "no job backend attached: jobs are accepted and stored but stay queued "
                "(nothing runs them in this process)"
            )
        else:
            ctx.backend = backend_factory(ctx.reporter)
            log.info("job backend attached: %s", type(ctx.backend).__name__)
        await hub.start()
        try:
            yield
        finally:
            await hub.close()  # before the backend: its device may be the one the hub uses
            if ctx.backend is not None:
                limit = ctx.settings.shutdown_timeout_s
                try:
                    await asyncio.wait_for(ctx.backend.close(), limit)
                except TimeoutError:
                    log.error(
                        "the job backend did not stop within %g s; exiting anyway (running "
                        "jobs resume from their last checkpoint at the next start)",
                        limit,
                    )
                ctx.backend = None
            ctx.db.close()

    app = FastAPI(
        title="marlaas",
        version=__version__,
        description="Multi-tenant asynchronous RL as a service: submit and manage RL "
        "fine-tuning jobs (one LoRA adapter per tenant) on a shared base model. "
        "Authenticate every request with `Authorization: Bearer <API key>`.",
        lifespan=lifespan,
    )
    app.state.context = ctx
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    for module in (ops, admin, jobs, datasets, usage, openai_api, web):
        app.include_router(module.router)
    for router in openai_ft.routers():  # OpenAI-compatible fine-tuning (files, jobs, graders)
        app.include_router(router)
    hub = tinker.install(app, ctx)  # the Tinker-compatible API under /api/v1
    app.add_middleware(AllowedMethods, paths=lambda: app.openapi()["paths"])
    # Added last = outermost: the timer sees the 413s that BodyLimit answers.
    app.add_middleware(
        BodyLimit,
        max_body=ctx.settings.max_body_bytes,
        max_upload=ctx.settings.max_upload_bytes,
    )
    app.add_middleware(RequestTimer, metrics=ctx.request_metrics)
    return app
