"""Tenant job routes under /v1: create, list, get, cancel, pause, resume, delete,
metrics, checkpoints, the event stream, adapter downloads, and the caller's own quotas
and usage.

Routes that touch the backend are coroutines: the database work runs in a worker
thread (one transaction), then the backend is told. The database is the source of
truth, so the backend is only called after the transaction committed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Header, Path, Query, Response, status
from fastapi.responses import StreamingResponse
from sqlalchemy import select

from marlaas.config.job import MAX_STEPS, JobSpec
from marlaas.service import jobs as ops
from marlaas.service import quotas
from marlaas.service.api.deps import AUTH_ERRORS, Context, TenantCaller, responses, tenant_id
from marlaas.service.archive import ArchiveFormat, open_adapter, stream_archive
from marlaas.service.context import ServiceContext
from marlaas.service.deletion import purge_deleted_jobs
from marlaas.service.errors import NotFound
from marlaas.service.events import stream_events
from marlaas.service.inference import provider_of
from marlaas.service.judges import check_job_judges
from marlaas.service.lifecycle import Action, JobStatus
from marlaas.service.models import Checkpoint, Job, Metric, Tenant
from marlaas.service.schemas import (
    CheckpointList,
    JobList,
    JobOut,
    MeOut,
    MetricsOut,
    checkpoint_out,
    job_out,
    metric_out,
    tenant_out,
    usage_out,
)

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["jobs"], responses=AUTH_ERRORS)

_ERRORS = responses({404: "No such job (or not yours)."})
#: Largest id of an event (a 64-bit column).
MAX_EVENT_ID = 2**63 - 1
#: A step: an adapter version, at most a job's largest `steps`.
Step = Annotated[int, Path(ge=0, le=MAX_STEPS, description="A step (= adapter version).")]


@router.get("/me", response_model=MeOut, tags=["tenant"])
def me(ctx: Context, caller: TenantCaller) -> MeOut:
    """The calling tenant, its quotas and its current usage of them."""
    with ctx.db.transaction() as session:
        tenant = session.get(Tenant, tenant_id(caller))
        assert tenant is not None
        return MeOut(tenant=tenant_out(tenant), usage=usage_out(quotas.usage(session, tenant.id)))


async def _fail(ctx: ServiceContext, job_id: str, error: Exception) -> None:
    """The backend refused a call: the job fails with the backend's error as reason."""
    log.exception("backend failed on job %s", job_id)
    await ctx.reporter.status(job_id, JobStatus.FAILED, f"backend error: {error}")


@router.post(
    "/jobs",
    status_code=status.HTTP_201_CREATED,
    response_model=JobOut,
    responses=responses(
        {
            400: "The body is not valid JSON.",
            409: "A job of that name exists.",
            422: "Invalid spec, or one this server's model and engine cannot run, or a task "
            "that cannot start; `detail` lists each field and what to change.",
            413: "The body is larger than this service's limit.",
            429: "A quota would be exceeded; the message names it and its limit.",
        }
    ),
)
async def create_job(spec: JobSpec, ctx: Context, caller: TenantCaller) -> JobOut:
    """Create a job from a validated spec. Nothing is stored unless every check passes:
    the spec's bounds, what the served model and this server's engine can take, the
    task itself (a dataset's rows read, its prompts tokenized, its grader built, its
    judge models the tenant's), and the tenant's quotas of the job's cost (see
    `service.admission`)."""
    tenant, settings = tenant_id(caller), ctx.settings
    limits = {"max_rank": settings.max_lora_rank, "max_staleness": settings.max_staleness}

    def precheck() -> JobSpec:
        with ctx.db.transaction() as session:
            return ops.precheck_job(session, tenant, spec, settings.artifact_dir, **limits)

    runnable = await asyncio.to_thread(precheck)
    await check_job_judges(ctx.inference_hub(), tenant, spec)
    shared = provider_of(ctx.inference, ctx.backend)
    cost = await ctx.admission.assess(spec, runnable, shared)

    def create() -> JobOut:
        with ctx.db.transaction() as session:
            return job_out(ops.create_job(session, tenant, spec, cost, **limits))

    out = await asyncio.to_thread(create)
    ctx.reporter.notifier.notify(out.id)
    if ctx.backend is not None:
        try:
            await ctx.backend.submit(out.id, runnable)
        except Exception as e:
            await _fail(ctx, out.id, e)
            return await asyncio.to_thread(_get, ctx, tenant_id(caller), out.id)
    return out


@router.get("/jobs", response_model=JobList)
def list_jobs(
    ctx: Context,
    caller: TenantCaller,
    only: Annotated[
        JobStatus | None, Query(alias="status", description="Only this status.")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
) -> JobList:
    """The caller's jobs, newest first, optionally only those in `status`."""
    with ctx.db.transaction() as session:
        rows = ops.list_jobs(session, tenant_id(caller), status=only, limit=limit, offset=offset)
        return JobList(jobs=[job_out(j) for j in rows])


def _get(ctx: ServiceContext, tenant: str, job_id: str) -> JobOut:
    with ctx.db.transaction() as session:
        return job_out(ops.get_job(session, tenant, job_id))


@router.get("/jobs/{job_id}", response_model=JobOut, responses=_ERRORS)
def get_job(job_id: str, ctx: Context, caller: TenantCaller) -> JobOut:
    return _get(ctx, tenant_id(caller), job_id)


async def act(ctx: ServiceContext, caller: TenantCaller, job_id: str, action: Action) -> JobOut:
    """Record the tenant's `action` on the job, then tell the backend (also the OpenAI
    fine-tuning routes' cancel, pause and resume)."""

    def apply() -> JobOut:
        with ctx.db.transaction() as session:
            return job_out(ops.apply_action(session, tenant_id(caller), job_id, action))

    out = await asyncio.to_thread(apply)
    ctx.reporter.notifier.notify(job_id)
    if ctx.backend is not None:
        call = {
            Action.CANCEL: ctx.backend.cancel,
            Action.PAUSE: ctx.backend.pause,
            Action.RESUME: ctx.backend.unpause,
        }[action]
        try:
            await call(job_id)
        except Exception as e:
            await _fail(ctx, job_id, e)
            return await asyncio.to_thread(_get, ctx, tenant_id(caller), job_id)
    return out


_ACTION_ERRORS = responses(
    {404: "No such job (or not yours).", 409: "The job's status does not allow this."}
)


@router.post("/jobs/{job_id}/cancel", response_model=JobOut, responses=_ACTION_ERRORS)
async def cancel_job(job_id: str, ctx: Context, caller: TenantCaller) -> JobOut:
    """Stop a queued, running or paused job for good."""
    return await act(ctx, caller, job_id, Action.CANCEL)


@router.post("/jobs/{job_id}/pause", response_model=JobOut, responses=_ACTION_ERRORS)
async def pause_job(job_id: str, ctx: Context, caller: TenantCaller) -> JobOut:
    """Pause a queued or running job; it keeps its state and its quota slot."""
    return await act(ctx, caller, job_id, Action.PAUSE)


@router.post("/jobs/{job_id}/resume", response_model=JobOut, responses=_ACTION_ERRORS)
async def resume_job(job_id: str, ctx: Context, caller: TenantCaller) -> JobOut:
    """Queue a paused job again; it becomes running when the backend picks it up."""
    return await act(ctx, caller, job_id, Action.RESUME)


@router.delete(
    "/jobs/{job_id}",
    status_code=status.HTTP_204_NO_CONTENT,
    response_class=Response,
    responses={
        **_ERRORS,
        409: {"description": "The job is queued, running or paused: cancel it first."},
    },
)
async def delete_job(job_id: str, ctx: Context, caller: TenantCaller) -> Response:
    """Delete a done, failed or cancelled job for good: its checkpoints and adapters are
    removed, and the job is gone from every listing, download and model list (404
    afterwards, its name free again). The steps it used still count toward your
    `max_total_steps` quota. An uploaded dataset it trained on is kept."""

    def hide() -> None:
        with ctx.db.transaction() as session:
            ops.delete_job(session, tenant_id(caller), job_id)

    await asyncio.to_thread(hide)  # committed: the job is gone for the tenant
    ctx.reporter.notifier.notify(job_id)
    try:  # this job's files, and any a crash left behind of earlier deletes
        await asyncio.to_thread(purge_deleted_jobs, ctx.db, ctx.settings.artifact_dir)
    except Exception:
        log.exception(
            "job %s is deleted but removing deleted jobs' files failed; the next delete "
            "or start of the service retries",
            job_id,
        )
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/jobs/{job_id}/metrics", response_model=MetricsOut, responses=_ERRORS)
def job_metrics(
    job_id: str,
    ctx: Context,
    caller: TenantCaller,
    name: Annotated[list[str] | None, Query(description="Only these metrics.")] = None,
    since_step: Annotated[int, Query(ge=0, le=MAX_STEPS, description="Only steps >= this.")] = 0,
    until_step: Annotated[
        int | None, Query(ge=0, le=MAX_STEPS, description="Only steps <= this.")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
) -> MetricsOut:
    """The job's scalars per step, ordered by step then name."""
    with ctx.db.transaction() as session:
        job = ops.get_job(session, tenant_id(caller), job_id)
        query = select(Metric).where(Metric.job_id == job.id, Metric.step >= since_step)
        if until_step is not None:
            query = query.where(Metric.step <= until_step)
        if name:
            query = query.where(Metric.name.in_(name))
        rows = session.scalars(query.order_by(Metric.step, Metric.name, Metric.id).limit(limit))
        return MetricsOut(job_id=job.id, points=[metric_out(m) for m in rows])


@router.get("/jobs/{job_id}/checkpoints", response_model=CheckpointList, responses=_ERRORS)
def job_checkpoints(job_id: str, ctx: Context, caller: TenantCaller) -> CheckpointList:
    """The job's checkpoints with their metrics, oldest first."""
    with ctx.db.transaction() as session:
        job: Job = ops.get_job(session, tenant_id(caller), job_id)
        rows = session.scalars(
            select(Checkpoint).where(Checkpoint.job_id == job.id).order_by(Checkpoint.step)
        )
        return CheckpointList(job_id=job.id, checkpoints=[checkpoint_out(c) for c in rows])


_LAST_EVENT_ID = {
    "name": "Last-Event-ID",
    "in": "header",
    "required": False,
    "description": "Resume after this event id (sent by reconnecting SSE clients); wins "
    "over `after`.",
    "schema": {"type": "integer", "minimum": 0, "maximum": MAX_EVENT_ID},
}


@router.get(
    "/jobs/{job_id}/events",
    response_class=StreamingResponse,
    openapi_extra={"parameters": [_LAST_EVENT_ID]},
    responses={
        **_ERRORS,
        200: {
            "description": "Server-sent events, in id order: `status`, `step` (with "
            "metrics) and `checkpoint`, each with `id:` and a JSON `data:` "
            "(`id`, `job_id`, `kind`, `time`, `data`); then one `end` event (data: "
            "`status`, `last_event_id`) once the job is terminal (with `follow=false`: "
            "once the history was sent). A stream that stops "
            "without `end` was cut: reconnect with `Last-Event-ID`.",
            "content": {"text/event-stream": {}},
        },
    },
)
async def job_events(
    job_id: str,
    ctx: Context,
    caller: TenantCaller,
    after: Annotated[
        int, Query(ge=0, le=MAX_EVENT_ID, description="Only events with a larger id.")
    ] = 0,
    follow: Annotated[
        bool,
        Query(
            description="Wait for new events until the job ends; false: send "
            "what exists, then `end`."
        ),
    ] = True,
    last_event_id: Annotated[
        int | None,
        # Documented by hand (`_LAST_EVENT_ID`): a header is never null, which the
        # generated schema of an optional parameter would allow.
        Header(alias="Last-Event-ID", ge=0, le=MAX_EVENT_ID, include_in_schema=False),
    ] = None,
) -> StreamingResponse:
    """Stream the job's progress as server-sent events, resumable after an event id."""
    # The header (a reconnecting SSE client's) wins over `?after=`.
    start = after if last_event_id is None else last_event_id
    await asyncio.to_thread(_get, ctx, tenant_id(caller), job_id)  # 404 before streaming
    return StreamingResponse(
        stream_events(ctx.db, ctx.reporter.notifier, job_id, after=start, follow=follow),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


_DOWNLOAD: dict[int | str, dict[str, Any]] = {
    **_ERRORS,
    200: {
        "description": "The PEFT adapter directory (adapter_config.json, "
        "adapter_model.safetensors) in one folder, as an archive. `X-Marlaas-Step` "
        "names the checkpoint's step (= adapter version).",
        "content": {"application/gzip": {}, "application/zip": {}},
    },
}
FormatQuery = Annotated[ArchiveFormat, Query(alias="format", description="Archive format.")]


def _checkpoint(
    ctx: ServiceContext, tenant: str, job_id: str, step: int | None
) -> tuple[str, int, str]:
    """(job name, step, stored path) of the job's checkpoint at `step`, or its newest."""
    with ctx.db.transaction() as session:
        job = ops.get_job(session, tenant, job_id)
        query = select(Checkpoint).where(Checkpoint.job_id == job.id)
        if step is None:
            ckpt = session.scalars(query.order_by(Checkpoint.step.desc()).limit(1)).first()
            if ckpt is None:
                raise NotFound(
                    f"job {job_id!r} has no checkpoint yet; its adapter can be downloaded "
                    "once it wrote one (see GET /v1/jobs/{id}/checkpoints)"
                )
        else:
            ckpt = session.scalars(query.where(Checkpoint.step == step)).first()
            if ckpt is None:
                raise NotFound(
                    f"job {job_id!r} has no checkpoint at step {step}; list them with "
                    f"GET /v1/jobs/{job_id}/checkpoints"
                )
        return job.name, ckpt.step, ckpt.path


async def _download(
    ctx: ServiceContext, caller: TenantCaller, job_id: str, step: int | None, fmt: ArchiveFormat
) -> StreamingResponse:
    name, found, path = await asyncio.to_thread(_checkpoint, ctx, tenant_id(caller), job_id, step)
    files = await asyncio.to_thread(open_adapter, ctx.settings.artifact_dir, path, found)
    folder = f"{name}-step-{found}"
    return StreamingResponse(
        stream_archive(fmt, folder, files),
        media_type=fmt.media_type,
        headers={
            "Content-Disposition": f'attachment; filename="{folder}.{fmt}"',
            "X-Marlaas-Step": str(found),
        },
    )


@router.get(
    "/jobs/{job_id}/checkpoints/{step}/adapter",
    response_class=StreamingResponse,
    responses=_DOWNLOAD,
)
async def download_checkpoint_adapter(
    job_id: str,
    step: Step,
    ctx: Context,
    caller: TenantCaller,
    fmt: FormatQuery = ArchiveFormat.TAR_GZ,
) -> StreamingResponse:
    """Download the adapter of the checkpoint at `step` (its adapter version) as a PEFT
    directory archive."""
    return await _download(ctx, caller, job_id, step, fmt)


@router.get("/jobs/{job_id}/adapter", response_class=StreamingResponse, responses=_DOWNLOAD)
async def download_latest_adapter(
    job_id: str, ctx: Context, caller: TenantCaller, fmt: FormatQuery = ArchiveFormat.TAR_GZ
) -> StreamingResponse:
    """Download the job's newest checkpoint's adapter (the final adapter once the job is
    done: a job always checkpoints its last step) as a PEFT directory archive."""
    return await _download(ctx, caller, job_id, None, fmt)
