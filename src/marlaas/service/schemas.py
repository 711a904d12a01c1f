"""Wire schemas: what the API reads and writes, separate from the tables, with explicit
conversion (`*_out`). The job spec itself is `marlaas.config.job.JobSpec`, so the
API validates exactly what `marlaas run` validates."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from marlaas.config.job import NAME_RULE, NAME_SCHEMA, JobSpec, check_name
from marlaas.service.lifecycle import JobStatus
from marlaas.service.models import ApiKey, Checkpoint, Dataset, Job, Metric, Tenant
from marlaas.service.quotas import Usage
from marlaas.service.settings import (
    QUOTA_DOCS,
    ConcurrentJobs,
    DatasetBytes,
    EvalEpisodes,
    InferenceRequests,
    InferenceTokens,
    QuotaSpec,
    SamplesPerStep,
    TokensPerStep,
    TotalSteps,
)

log = logging.getLogger(__name__)


class Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class QuotaPatch(Wire):
    """Quota fields to change; those left out keep their value."""

    max_concurrent_jobs: ConcurrentJobs | None = Field(
        None, description=QUOTA_DOCS["max_concurrent_jobs"]
    )
    max_total_steps: TotalSteps | None = Field(None, description=QUOTA_DOCS["max_total_steps"])
    max_dataset_bytes: DatasetBytes | None = Field(
        None, description=QUOTA_DOCS["max_dataset_bytes"]
    )
    max_samples_per_step: SamplesPerStep | None = Field(
        None, description=QUOTA_DOCS["max_samples_per_step"]
    )
    max_eval_episodes: EvalEpisodes | None = Field(
        None, description=QUOTA_DOCS["max_eval_episodes"]
    )
    max_tokens_per_step: TokensPerStep | None = Field(
        None, description=QUOTA_DOCS["max_tokens_per_step"]
    )
    max_inference_requests: InferenceRequests | None = Field(
        None, description=QUOTA_DOCS["max_inference_requests"]
    )
    max_inference_tokens: InferenceTokens | None = Field(
        None, description=QUOTA_DOCS["max_inference_tokens"]
    )


class TenantCreate(Wire):
    name: str = Field(
        ..., description="Unique tenant name. " + NAME_RULE, json_schema_extra=NAME_SCHEMA
    )
    quotas: QuotaPatch = Field(
        default_factory=QuotaPatch, description="Quotas; left out: the service's defaults."
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v)


class TenantOut(Wire):
    id: str
    name: str
    quotas: QuotaSpec
    created_at: datetime


class UsageOut(Wire):
    active_jobs: int
    total_steps: int
    dataset_bytes: int


class MeOut(Wire):
    """The calling tenant, its quotas and what it uses of them."""

    tenant: TenantOut
    usage: UsageOut


class KeyCreate(Wire):
    label: str = Field("", max_length=128, description="A note for humans, e.g. 'ci'.")
    format: Literal["mk", "tml"] = Field(
        "mk", description="`tml`: spelled `tml-...`, as the `tinker` SDK requires."
    )


class KeyOut(Wire):
    id: str
    tenant: str | None = Field(None, description="Tenant name; None for an admin key.")
    prefix: str = Field(..., description="The public part of the key, `mk_<prefix>_...`.")
    label: str
    created_at: datetime
    revoked_at: datetime | None


class IssuedKeyOut(KeyOut):
    key: str = Field(..., description="The key itself. Shown only now; store it safely.")


class JobOut(Wire):
    id: str
    name: str
    status: JobStatus
    steps: int
    steps_done: int
    priority: float
    failure_reason: str | None
    created_at: datetime
    updated_at: datetime
    spec: JobSpec | dict[str, Any] = Field(
        ...,
        description="The job's spec. A job stored by an older server may hold one that "
        "today's bounds refuse: it is shown as stored (and the job was failed).",
    )


class JobList(Wire):
    jobs: list[JobOut]


class MetricPoint(Wire):
    step: int
    name: str
    value: float | None
    time: datetime


class MetricsOut(Wire):
    job_id: str
    points: list[MetricPoint]


class CheckpointOut(Wire):
    step: int
    metrics: dict[str, float | None]
    created_at: datetime


class CheckpointList(Wire):
    job_id: str
    checkpoints: list[CheckpointOut]


class DatasetOut(Wire):
    name: str
    size_bytes: int
    rows: int
    sha256: str
    created_at: datetime


class DatasetList(Wire):
    datasets: list[DatasetOut]


def quotas_of(tenant: Tenant) -> QuotaSpec:
    return QuotaSpec.model_validate(
        {name: getattr(tenant, name) for name in QuotaSpec.model_fields}
    )


def tenant_out(tenant: Tenant) -> TenantOut:
    return TenantOut(
        id=tenant.id, name=tenant.name, quotas=quotas_of(tenant), created_at=tenant.created_at
    )


def usage_out(usage: Usage) -> UsageOut:
    return UsageOut(
        active_jobs=usage.active_jobs,
        total_steps=usage.total_steps,
        dataset_bytes=usage.dataset_bytes,
    )


def key_out(key: ApiKey, tenant_name: str | None) -> KeyOut:
    return KeyOut(
        id=key.id,
        tenant=tenant_name,
        prefix=key.prefix,
        label=key.label,
        created_at=key.created_at,
        revoked_at=key.revoked_at,
    )


def job_out(job: Job) -> JobOut:
    return JobOut(
        id=job.id,
        name=job.name,
        status=JobStatus(job.status),
        steps=job.steps,
        steps_done=job.steps_done,
        priority=job.priority,
        failure_reason=job.failure_reason,
        created_at=job.created_at,
        updated_at=job.updated_at,
        spec=stored_spec(job),
    )


def stored_spec(job: Job) -> JobSpec | dict[str, Any]:
    """The job's spec. One stored before today's bounds (an older server took it) no
    longer validates; it is shown as stored rather than failing the read (such a job is
    failed when the server starts, see `pipeline_backend`)."""
    try:
        return JobSpec.model_validate(job.spec)
    except ValidationError:
        log.info("job %s: its stored spec no longer validates; shown as stored", job.id)
        return dict(job.spec)


def metric_out(metric: Metric) -> MetricPoint:
    return MetricPoint(step=metric.step, name=metric.name, value=metric.value, time=metric.time)


def checkpoint_out(ckpt: Checkpoint) -> CheckpointOut:
    metrics: dict[str, Any] = ckpt.metrics
    return CheckpointOut(step=ckpt.step, metrics=metrics, created_at=ckpt.created_at)


def dataset_out(ds: Dataset) -> DatasetOut:
    return DatasetOut(
        name=ds.name,
        size_bytes=ds.size_bytes,
        rows=ds.rows,
        sha256=ds.sha256,
        created_at=ds.created_at,
    )
