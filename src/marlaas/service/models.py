"""The service's tables (SQLAlchemy 2, typed). The schema itself is owned by the Alembic
migrations in `migrations/versions`; a test checks that these models and the migrated
schema agree.

Ids of tenants, keys and jobs are random strings (not counters), so an id says nothing
about how many others exist. Timestamps are stored in UTC.
"""

from __future__ import annotations

import secrets
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    """A random public id such as `job_3f9a...` (16 hex digits after the prefix)."""
    return f"{prefix}_{secrets.token_hex(8)}"


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend (SQLite stores naive values)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(UTC) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    pass


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    max_concurrent_jobs: Mapped[int] = mapped_column(Integer)
    max_total_steps: Mapped[int] = mapped_column(BigInteger)
    max_dataset_bytes: Mapped[int] = mapped_column(BigInteger)
    # Admission by cost (migration 0004); see `settings.QuotaSpec` for their meaning.
    max_samples_per_step: Mapped[int] = mapped_column(BigInteger)
    max_eval_episodes: Mapped[int] = mapped_column(Integer)
    max_tokens_per_step: Mapped[int] = mapped_column(BigInteger)
    max_inference_requests: Mapped[int] = mapped_column(Integer)
    max_inference_tokens: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ApiKey(Base):
    """A bearer key. `tenant_id` None marks an admin key. Only a keyed hash is stored:
    `hash = HMAC-SHA256(salt, secret)`, with a random salt per key."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str | None] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), index=True
    )
    prefix: Mapped[str] = mapped_column(String(32), unique=True)
    salt: Mapped[str] = mapped_column(String(64))
    hash: Mapped[str] = mapped_column(String(128))
    label: Mapped[str] = mapped_column(String(128), default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("tenant_id", "name", name="uq_jobs_tenant_name"),
        Index("ix_jobs_tenant_status", "tenant_id", "status"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(64))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16))
    steps: Mapped[int] = mapped_column(Integer)
    steps_done: Mapped[int] = mapped_column(Integer, default=0)
    priority: Mapped[float] = mapped_column(Float)
    failure_reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    #: Set when the tenant deleted the job: the row stays (quotas count its steps) but
    #: is hidden everywhere, and its files are removed (see `marlaas.service.deletion`).
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    tenant: Mapped[Tenant] = relationship()


class Checkpoint(Base):
    """A checkpoint the runner wrote; `path` is relative to the artifact directory."""

    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("job_id", "step", name="uq_checkpoints_job_step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(String(512))
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Metric(Base):
    """One scalar of a job at a step (reward, loss, eval accuracy, ...)."""

    __tablename__ = "metrics"
    __table_args__ = (Index("ix_metrics_job_name_step", "job_id", "name", "step"),)

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(64))
    value: Mapped[float | None] = mapped_column(Float)
    time: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class JobEvent(Base):
    """What happened to a job, in order (status changes, checkpoints); the id orders them,
    so a stream can resume after the last id it saw."""

    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(32))
    data: Mapped[dict[str, Any]] = mapped_column(JSON)
    time: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Dataset(Base):
    """An uploaded JSONL file; stored at `path`, relative to the artifact directory."""

    __tablename__ = "datasets"
    __table_args__ = (UniqueConstraint("tenant_id", "name", name="uq_datasets_tenant_name"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(64))
    path: Mapped[str] = mapped_column(String(512))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    rows: Mapped[int] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class File(Base):
    """A file uploaded through the OpenAI-compatible Files API. Its bytes are the
    tenant's dataset named by the file's id (`Dataset.name == File.id`), so quotas, the
    in-use check and jobs treat it like any upload; this row holds OpenAI's view of it."""

    __tablename__ = "files"
    __table_args__ = (Index("ix_files_tenant_created", "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    filename: Mapped[str] = mapped_column(String(256))
    purpose: Mapped[str] = mapped_column(String(32))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    rows: Mapped[int] = mapped_column(Integer)
    #: `processed` (valid) or `error` (`status_details` says which line and why).
    status: Mapped[str] = mapped_column(String(16))
    status_details: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class FineTuningJob(Base):
    """What an OpenAI fine-tuning request said of a job beyond its `JobSpec`: the job
    itself is an ordinary row of `jobs` with the same id."""

    __tablename__ = "fine_tuning_jobs"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    model: Mapped[str] = mapped_column(String(200))
    training_file: Mapped[str] = mapped_column(String(40))
    validation_file: Mapped[str | None] = mapped_column(String(40))
    suffix: Mapped[str | None] = mapped_column(String(64))
    seed: Mapped[int] = mapped_column(BigInteger)
    #: The method with every hyperparameter resolved (`auto` replaced by its value).
    method: Mapped[dict[str, Any]] = mapped_column(JSON)
    #: OpenAI's `metadata` (the attribute name `metadata` is SQLAlchemy's own).
    tags: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON)
    #: `ft:BASE:TENANT:SUFFIX:JOB`, the name the trained model answers to.
    fine_tuned_model: Mapped[str] = mapped_column(String(400))


class TinkerRun(Base):
    """A training run of the Tinker-compatible API (`marlaas.service.tinker`): one LoRA
    adapter of a tenant, trained by a `tinker` SDK client. `status` is `active` while
    it is on the device, `closed` once its session finished or the server restarted
    (its saved states can be loaded into a new run)."""

    __tablename__ = "tinker_runs"
    __table_args__ = (Index("ix_tinker_runs_tenant_status", "tenant_id", "status"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    session_id: Mapped[str] = mapped_column(String(32))
    base_model: Mapped[str] = mapped_column(String(512))
    lora: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16))
    #: Optimizer steps taken (they count toward the tenant's `max_total_steps`).
    steps: Mapped[int] = mapped_column(Integer, default=0)
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_request_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class TinkerCheckpoint(Base):
    """A saved state (`kind` training: adapter, optimizer, version) or sampler weights
    (`kind` sampler: a PEFT adapter) of a Tinker run, at `tinker://<run>/<...>/<name>`;
    `path` is relative to the artifact directory."""

    __tablename__ = "tinker_checkpoints"
    __table_args__ = (
        UniqueConstraint("run_id", "kind", "name", name="uq_tinker_checkpoints_run_kind_name"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(
        ForeignKey("tinker_runs.id", ondelete="CASCADE"), index=True
    )
    kind: Mapped[str] = mapped_column(String(16))
    name: Mapped[str] = mapped_column(String(128))
    path: Mapped[str] = mapped_column(String(512))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    #: The adapter version (optimizer steps of the run) the weights were saved at.
    version: Mapped[int] = mapped_column(Integer)
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
