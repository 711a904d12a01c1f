"""Job operations inside one transaction: create (validated, within quota), find
(always scoped to the caller's tenant), list, apply a tenant's action, and delete.

Scoping rule: every lookup filters by tenant id in the query itself, so a job of
another tenant is simply not found, and the caller answers the same 404 as for an id
that never existed. A deleted job (`deleted_at` set) is not found either: the same 404.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from marlaas.config.job import DatasetSpec, JobSpec
from marlaas.config.specs import TaskSpec
from marlaas.service import datasets, quotas
from marlaas.service.errors import Conflict, InvalidField, NotFound
from marlaas.service.lifecycle import TERMINAL, Action, JobStatus, action_target, allowed_from
from marlaas.service.models import Dataset, Job, JobEvent, Metric, Tenant, new_id, utcnow

if TYPE_CHECKING:
    from marlaas.service.admission import JobCost


def job_not_found() -> NotFound:
    """The one 404 for a job id that is missing or belongs to someone else: the same
    message whatever the id, so the answer tells nothing about other tenants."""
    return NotFound("no such job; list your jobs with GET /v1/jobs")


def _check_task(session: Session, tenant_id: str, spec: JobSpec) -> None:
    """What pydantic cannot know: the task family exists, a dataset was uploaded."""
    task = spec.task
    if isinstance(task, TaskSpec):
        from marlaas.envs.tasks import FAMILIES

        family = FAMILIES.get(task.family)
        if family is None:
            raise InvalidField(
                ("body", "task", "family"),
                f"unknown task family {task.family!r}; known: {', '.join(sorted(FAMILIES))}",
            )
        knobs = {p for p in inspect.signature(family).parameters}
        unknown = sorted(set(task.options) - knobs)
        if unknown:
            raise InvalidField(
                ("body", "task", "options"),
                f"task family {task.family!r} has no option(s) {', '.join(unknown)}; "
                f"its options are: {', '.join(sorted(knobs))}",
            )
    elif isinstance(task, DatasetSpec):
        for field, name in (("path", task.path), ("eval_path", task.eval_path)):
            if name is None:
                continue
            found = session.scalar(
                select(Dataset.id).where(Dataset.tenant_id == tenant_id, Dataset.name == name)
            )
            if found is None:
                raise InvalidField(
                    ("body", "task", field),
                    f"no uploaded dataset named {name!r}; upload it first with "
                    f"PUT /v1/datasets/{{name}}, then give its name as task.{field}",
                )


def _check_limits(spec: JobSpec, max_rank: int, max_staleness: int) -> None:
    """The shared pipeline is sized for these (adapter slots, bank version window)."""
    if spec.lora.rank > max_rank:
        raise InvalidField(
            ("body", "lora", "rank"),
            f"LoRA rank {spec.lora.rank} is above this service's limit of {max_rank}",
        )
    if not spec.supervised and spec.grpo.max_staleness > max_staleness:
        raise InvalidField(
            ("body", "algorithm", "max_staleness"),
            f"max_staleness {spec.grpo.max_staleness} is above this service's limit "
            f"of {max_staleness}",
        )


def add_event(session: Session, job: Job, kind: str, data: dict[str, Any]) -> None:
    session.add(JobEvent(job_id=job.id, kind=kind, data=data, time=utcnow()))


def _check_name_free(session: Session, tenant_id: str, name: str) -> None:
    taken = session.scalar(select(Job.id).where(Job.tenant_id == tenant_id, Job.name == name))
    if taken is not None:
        raise Conflict(f"you already have a job named {name!r} ({taken}); pick another name")


def precheck_job(
    session: Session,
    tenant_id: str,
    spec: JobSpec,
    artifact_dir: Path,
    *,
    max_rank: int,
    max_staleness: int,
) -> JobSpec:
    """The cheap checks of `create_job`, before the costly ones of `admission` run:
    returns the spec the pipeline runs (a dataset's name replaced by its file)."""
    tenant = session.get(Tenant, tenant_id)
    assert tenant is not None  # authenticated tenants exist
    _check_limits(spec, max_rank, max_staleness)
    _check_task(session, tenant_id, spec)
    _check_name_free(session, tenant_id, spec.name)
    quotas.check_new_job(session, tenant, spec.steps)
    return datasets.resolve_spec(session, tenant_id, spec, artifact_dir)


def create_job(
    session: Session,
    tenant_id: str,
    spec: JobSpec,
    cost: JobCost,
    *,
    max_rank: int,
    max_staleness: int,
) -> Job:
    """Insert a queued job for the tenant, after the spec and quota checks (`cost`: what
    `admission` found the job asks).

    Raises `InvalidField` (422), `Conflict` (409, name taken) or `QuotaExceeded` (429);
    the caller's transaction then rolls back, so nothing is left behind.
    """
    tenant = session.get(Tenant, tenant_id, with_for_update=True)
    assert tenant is not None  # authenticated tenants exist
    _check_limits(spec, max_rank, max_staleness)
    _check_task(session, tenant_id, spec)
    _check_name_free(session, tenant_id, spec.name)
    quotas.check_new_job(session, tenant, spec.steps)
    quotas.check_job_cost(tenant, cost)
    now = utcnow()
    job = Job(
        id=new_id("job"),
        tenant_id=tenant_id,
        name=spec.name,
        spec=spec.model_dump(mode="json"),
        status=JobStatus.QUEUED,
        steps=spec.steps,
        steps_done=0,
        priority=spec.priority,
        created_at=now,
        updated_at=now,
    )
    session.add(job)
    try:
        session.flush()
    except IntegrityError:  # a concurrent request took the name between check and insert
        raise Conflict(f"you already have a job named {spec.name!r}; pick another name") from None
    add_event(session, job, "status", {"status": str(JobStatus.QUEUED)})
    return job


def visible() -> ColumnElement[bool]:
    """The filter of jobs that exist for their tenant: every job not deleted."""
    return Job.deleted_at.is_(None)


def get_job(session: Session, tenant_id: str, job_id: str, *, lock: bool = False) -> Job:
    """The tenant's job `job_id`; `NotFound` if missing or another tenant's."""
    query = select(Job).where(Job.id == job_id, Job.tenant_id == tenant_id, visible())
    if lock:
        query = query.with_for_update()
    job = session.scalars(query).one_or_none()
    if job is None:
        raise job_not_found()
    return job


def list_jobs(
    session: Session,
    tenant_id: str,
    *,
    status: JobStatus | None = None,
    limit: int = 100,
    offset: int = 0,
) -> Sequence[Job]:
    """The tenant's jobs, newest first."""
    query = select(Job).where(Job.tenant_id == tenant_id, visible())
    if status is not None:
        query = query.where(Job.status == status)
    query = query.order_by(Job.created_at.desc(), Job.id).limit(limit).offset(offset)
    return session.scalars(query).all()


def apply_action(session: Session, tenant_id: str, job_id: str, action: Action) -> Job:
    """Move the job as `action` asks; `Conflict` (409) when its status does not allow it."""
    job = get_job(session, tenant_id, job_id, lock=True)
    current = JobStatus(job.status)
    target = action_target(action, current)
    if target is None:
        raise Conflict(
            f"cannot {action} job {job_id!r}: it is {current}; {action} applies only to "
            f"jobs that are {allowed_from(action)}"
        )
    job.status = target
    job.updated_at = utcnow()
    add_event(session, job, "status", {"status": str(target), "action": str(action)})
    return job


def deleted_name(job_id: str) -> str:
    """What a deleted job's `name` becomes, so that the tenant can use the name again
    (the original stays in its spec). Never a valid job name, so never taken."""
    return f"deleted:{job_id}"


def delete_job(session: Session, tenant_id: str, job_id: str) -> Job:
    """Hide a finished job for good: `Conflict` (409) unless it is done, failed or
    cancelled. The row stays (quotas count the steps it used, see `quotas`), renamed
    to free its name; its metrics and events go now, its checkpoint rows once their
    files are removed (`deletion.purge_deleted_jobs`, after this transaction commits).
    """
    job = get_job(session, tenant_id, job_id, lock=True)
    current = JobStatus(job.status)
    if current not in TERMINAL:
        raise Conflict(
            f"cannot delete job {job_id!r}: it is {current}; cancel it first "
            f"(POST /v1/jobs/{job_id}/cancel), then delete it"
        )
    now = utcnow()
    job.deleted_at = now
    job.updated_at = now
    job.name = deleted_name(job.id)
    session.execute(delete(Metric).where(Metric.job_id == job.id))
    session.execute(delete(JobEvent).where(JobEvent.job_id == job.id))
    return job


def spec_of(job: Job) -> JobSpec:
    return JobSpec.model_validate(job.spec)
