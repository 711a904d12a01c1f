"""OpenAI-compatible fine-tuning job routes under `/v1/fine_tuning/jobs`: create, list
(cursor `after`, `limit`, `metadata[k]=v` filter), retrieve, cancel, pause, resume,
events and checkpoints.

A job is created as an ordinary marlaas job (`service.jobs.create_job`: the same
quotas, checks and backend) from the spec `convert.job_spec` makes, plus a
`fine_tuning_jobs` row with what the request said beyond it; both in one transaction.
Lists are newest first, as OpenAI's are. Another tenant's job answers 404 exactly like
a missing one, and so does a marlaas job made through the native API (it has no OpenAI
view).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from marlaas.config.job import JobSpec
from marlaas.service import datasets
from marlaas.service import jobs as ops
from marlaas.service.api.deps import Context, TenantCaller, tenant_id
from marlaas.service.api.jobs import act
from marlaas.service.context import ServiceContext
from marlaas.service.inference import provider_of
from marlaas.service.lifecycle import Action, JobStatus
from marlaas.service.models import Checkpoint, FineTuningJob, Job, JobEvent, Metric, Tenant
from marlaas.service.openai_ft import convert, wire
from marlaas.service.openai_ft.errors import (
    ERRORS,
    NOT_FOUND,
    FineTuningRoute,
    bad_request,
    not_found,
)
from marlaas.service.openai_ft.file_check import check_conversations, check_prompts
from marlaas.service.openai_ft.files import file_path, find_file
from marlaas.service.openai_ft.graders import check_judges
from marlaas.service.openai_ft.names import fine_tuned_model
from marlaas.service.openai_ft.results import result_files

log = logging.getLogger(__name__)
router = APIRouter(
    prefix="/v1/fine_tuning/jobs",
    tags=["openai fine-tuning"],
    route_class=FineTuningRoute,
    responses=ERRORS,
)
_HINT = "List your fine-tuning jobs with GET /v1/fine_tuning/jobs."


def _job(session: Session, tenant: str, job_id: str) -> tuple[Job, FineTuningJob]:
    found = session.execute(
        select(Job, FineTuningJob)
        .join(FineTuningJob, FineTuningJob.job_id == Job.id)
        .where(Job.id == job_id, Job.tenant_id == tenant, ops.visible())
    ).one_or_none()
    if found is None:
        raise not_found("fine-tuning job", job_id, _HINT)
    return found[0], found[1]


def _object(session: Session, job: Job, ft: FineTuningJob) -> dict[str, Any]:
    tenant = session.get(Tenant, job.tenant_id)
    assert tenant is not None
    tokens = session.scalar(
        select(func.sum(Metric.value)).where(Metric.job_id == job.id, Metric.name == "tokens")
    )
    trained = int(tokens) if tokens is not None else 0
    results = result_files(session, job)
    return wire.job_object(job, ft, tenant.name, trained, datetime.now(UTC), results)


def _read(ctx: ServiceContext, tenant: str, job_id: str) -> dict[str, Any]:
    with ctx.db.transaction() as session:
        return _object(session, *_job(session, tenant, job_id))


def _usable_file(session: Session, tenant: str, file_id: str, param: str) -> int:
    """The rows of the tenant's processed fine-tune file `file_id`; 400 naming `param`."""
    row = find_file(session, tenant, file_id)
    if row is None:
        raise bad_request(
            f"{param}: no file {file_id!r}; upload it with POST /v1/files (purpose fine-tune)",
            param,
            "invalid_file",
        )
    if row.status != "processed":
        raise bad_request(
            f"{param} {file_id} failed validation: {row.status_details}; fix the file and "
            "upload it again",
            param,
            "invalid_file",
        )
    return row.rows


def _row_problem(ctx: ServiceContext, tenant: str, file_id: str, supervised: bool) -> str | None:
    """The method's own check of a processed file: RFT rows end with the user turn,
    SFT rows have an assistant turn to train on (`line N: ...`)."""
    with ctx.db.transaction() as session:
        row = find_file(session, tenant, file_id)
        assert row is not None
        path = file_path(session, tenant, row, ctx.settings.artifact_dir)
    return check_conversations(path) if supervised else check_prompts(path)


def _check_chat_model(ctx: ServiceContext) -> None:
    """RFT prompts are chat messages, rendered with the base's chat template: a base
    without one is refused here, when the serving engine is up to tell (else the
    pipeline fails the job with the same reason)."""
    provider = provider_of(ctx.inference, ctx.backend)
    if provider is not None and not getattr(provider.tokenizer, "chat_template", None):
        raise bad_request(
            "model base cannot be fine-tuned on chat messages: its tokenizer has no chat "
            "template; serve a chat model (marlaas serve --base-model DIR)",
            "model",
            "model_not_available",
        )


@router.post("")
async def create_job(body: convert.CreateJob, ctx: Context, caller: TenantCaller) -> dict[str, Any]:
    """Create a supervised or reinforcement fine-tuning job; it is queued at once (files
    are validated when they are uploaded, and for the method when the job is created)."""
    tenant = tenant_id(caller)
    grader = convert.check_request(body)
    supervised = grader is None
    if grader is not None:  # a supervised job renders chats without a template too
        _check_chat_model(ctx)
        await check_judges(grader, ctx.inference_hub(), tenant, "method.reinforcement.grader")
    files = [("training_file", body.training_file)]
    if body.validation_file is not None:
        files.append(("validation_file", body.validation_file))

    def sizes() -> list[int]:
        with ctx.db.transaction() as session:
            return [_usable_file(session, tenant, fid, param) for param, fid in files]

    rows = await asyncio.to_thread(sizes)
    for param, fid in files:
        problem = await asyncio.to_thread(_row_problem, ctx, tenant, fid, supervised)
        if problem is not None:
            raise bad_request(f"{param} {fid}: {problem}", param, "invalid_file")
    resolved = convert.resolve(body, grader, rows[0], rows[1] if len(rows) > 1 else None)
    spec = convert.job_spec(body, resolved)

    def runnable_spec() -> JobSpec:
        with ctx.db.transaction() as session:
            return datasets.resolve_spec(session, tenant, spec, ctx.settings.artifact_dir)

    # The native route's checks of the job's cost (service.admission), before a row exists.
    runnable = await asyncio.to_thread(runnable_spec)
    cost = await ctx.admission.assess(spec, runnable, provider_of(ctx.inference, ctx.backend))

    def create() -> dict[str, Any]:
        with ctx.db.transaction() as session:
            job = ops.create_job(
                session,
                tenant,
                spec,
                cost,
                max_rank=ctx.settings.max_lora_rank,
                max_staleness=ctx.settings.max_staleness,
            )
            owner = session.get(Tenant, tenant)
            assert owner is not None
            ft = FineTuningJob(
                job_id=job.id,
                model=body.model,
                training_file=body.training_file,
                validation_file=body.validation_file,
                suffix=body.suffix,
                seed=resolved.seed,
                method=convert.method_record(resolved),
                tags=body.metadata,
                fine_tuned_model=fine_tuned_model(body.model, owner.name, body.suffix, job.id),
            )
            session.add(ft)
            session.flush()
            return _object(session, job, ft)

    out = await asyncio.to_thread(create)
    job_id = out["id"]
    ctx.reporter.notifier.notify(job_id)
    if ctx.backend is not None:
        try:
            await ctx.backend.submit(job_id, runnable)
        except Exception as e:  # the job fails with the backend's reason, as natively
            log.exception("backend failed on job %s", job_id)
            await ctx.reporter.status(job_id, JobStatus.FAILED, f"backend error: {e}")
        out = await asyncio.to_thread(_read, ctx, tenant, job_id)
    return out


def _metadata_filter(request: Request) -> dict[str, str]:
    """`metadata[k]=v` query parameters (the SDK's deep-object form)."""
    out: dict[str, str] = {}
    for key, value in request.query_params.multi_items():
        if key.startswith("metadata[") and key.endswith("]"):
            out[key[len("metadata[") : -1]] = value
    return out


@router.get("")
def list_jobs(
    request: Request,
    ctx: Context,
    caller: TenantCaller,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
) -> dict[str, Any]:
    """The caller's fine-tuning jobs, newest first."""
    wanted = _metadata_filter(request)
    null_only = request.query_params.get("metadata") == "null"
    with ctx.db.transaction() as session:
        rows = session.execute(
            select(Job, FineTuningJob)
            .join(FineTuningJob, FineTuningJob.job_id == Job.id)
            .where(Job.tenant_id == tenant_id(caller), ops.visible())
            .order_by(Job.created_at.desc(), Job.id.desc())
        ).all()
        picked = [
            (job, ft)
            for job, ft in rows
            if (
                ft.tags is None
                if null_only
                else all((ft.tags or {}).get(k) == v for k, v in wanted.items())
            )
        ]
        ids = [job.id for job, _ in picked]
        start = ids.index(after) + 1 if after in ids else (0 if after is None else len(ids))
        shown = picked[start : start + limit]
        data = [_object(session, job, ft) for job, ft in shown]  # only this page's
    return {
        "object": "list",
        "data": data,
        "has_more": start + limit < len(picked),
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }


@router.get("/{job_id}", responses=NOT_FOUND)
def retrieve_job(job_id: str, ctx: Context, caller: TenantCaller) -> dict[str, Any]:
    return _read(ctx, tenant_id(caller), job_id)


async def _action(
    ctx: ServiceContext, caller: TenantCaller, job_id: str, action: Action
) -> dict[str, Any]:
    tenant = tenant_id(caller)
    await asyncio.to_thread(_read, ctx, tenant, job_id)  # 404 unless an OpenAI job
    await act(ctx, caller, job_id, action)
    return await asyncio.to_thread(_read, ctx, tenant, job_id)


@router.post("/{job_id}/cancel", responses=NOT_FOUND)
async def cancel_job(job_id: str, ctx: Context, caller: TenantCaller) -> dict[str, Any]:
    """Stop a queued, running or paused job for good."""
    return await _action(ctx, caller, job_id, Action.CANCEL)


@router.post("/{job_id}/pause", responses=NOT_FOUND)
async def pause_job(job_id: str, ctx: Context, caller: TenantCaller) -> dict[str, Any]:
    """Pause a queued or running job; it keeps its state (and its quota slot)."""
    return await _action(ctx, caller, job_id, Action.PAUSE)


@router.post("/{job_id}/resume", responses=NOT_FOUND)
async def resume_job(job_id: str, ctx: Context, caller: TenantCaller) -> dict[str, Any]:
    """Continue a paused job from where it stopped."""
    return await _action(ctx, caller, job_id, Action.RESUME)


@router.get("/{job_id}/events", responses=NOT_FOUND)
def list_events(
    job_id: str,
    ctx: Context,
    caller: TenantCaller,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
) -> dict[str, Any]:
    """The job's events, newest first; `after` an event id: the older ones."""
    start = wire.cursor(after, wire.EVENT_PREFIX)
    with ctx.db.transaction() as session:
        job, ft = _job(session, tenant_id(caller), job_id)
        first = session.scalar(select(func.min(JobEvent.id)).where(JobEvent.job_id == job.id))
        query = select(JobEvent).where(JobEvent.job_id == job.id)
        if start is not None:
            query = query.where(JobEvent.id < start)
        rows = session.scalars(query.order_by(JobEvent.id.desc()).limit(limit + 1)).all()
        data = [wire.event_object(r, first or 0, job.steps, ft) for r in rows[:limit]]
    return {"object": "list", "data": data, "has_more": len(rows) > limit}


@router.get("/{job_id}/checkpoints", responses=NOT_FOUND)
def list_checkpoints(
    job_id: str,
    ctx: Context,
    caller: TenantCaller,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 10,
) -> dict[str, Any]:
    """The job's checkpoints, newest first; each answers as a model
    (`fine_tuned_model_checkpoint`)."""
    start = wire.cursor(after, wire.CHECKPOINT_PREFIX)
    with ctx.db.transaction() as session:
        job, ft = _job(session, tenant_id(caller), job_id)
        query = select(Checkpoint).where(Checkpoint.job_id == job.id)
        if start is not None:
            query = query.where(Checkpoint.id < start)
        rows = session.scalars(query.order_by(Checkpoint.id.desc()).limit(limit + 1)).all()
        data = [wire.checkpoint_object(r, ft) for r in rows[:limit]]
    return {
        "object": "list",
        "data": data,
        "has_more": len(rows) > limit,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }
