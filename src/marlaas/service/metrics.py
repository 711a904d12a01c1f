"""Prometheus figures, in a registry per app (no global state): request latencies by
route; per-tenant job counts by status, read from the database at scrape time so they
are right even after a restart; and the pipeline's own figures (device utilization,
per-stage busy time, queue depths, per-job progress) when the job backend reports them
(`PipelineFiguresSource`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from marlaas.service.db import Database
from marlaas.service.lifecycle import JobStatus
from marlaas.service.models import Job, Tenant


class JobCounts(Collector):
    """`marlaas_jobs{tenant, status}`: how many of each tenant's jobs are in each status."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "marlaas_jobs", "Jobs per tenant and status.", labels=["tenant", "status"]
        )
        with self._db.transaction() as session:
            rows = session.execute(
                select(Tenant.name, Job.status, func.count(Job.id))
                .join(Job, Job.tenant_id == Tenant.id)
                .where(Job.deleted_at.is_(None))
                .group_by(Tenant.name, Job.status)
            ).all()
            tenants = session.scalars(select(Tenant.name)).all()
        counts = {(t, s): n for t, s, n in rows}
        for tenant in tenants:
            for status in JobStatus:
                family.add_metric([tenant, str(status)], counts.get((tenant, str(status)), 0))
        yield family


@dataclass(frozen=True)
class PipelineFigures:
    """A snapshot of the shared pipeline, as a job backend sees it."""

    device_busy_fraction: float
    device_busy_fraction_recent: float
    decode_busy_s: float
    train_busy_s: float
    decode_iterations: int
    tokens_sampled: int
    train_steps: int
    engine_rows: int
    env_active: int
    env_calls: int
    env_errors: int
    env_timeouts: int
    #: Requests waiting for the engine, by job id.
    waiting_requests: dict[str, int] = field(default_factory=dict)
    #: Adapter version (steps trained) and highest staleness so far, by job id.
    job_steps: dict[str, int] = field(default_factory=dict)
    job_staleness_max: dict[str, int] = field(default_factory=dict)
    #: Tokens each job's sampling generated: its rollouts, evals and judge calls.
    job_tokens: dict[str, int] = field(default_factory=dict)


@runtime_checkable
class PipelineFiguresSource(Protocol):
    def pipeline_figures(self) -> PipelineFigures | None:
        """The figures now; None while the pipeline is not running. Must be quick and
        must not block on the device."""
        ...


class PipelineMetrics(Collector):
    """The backend's `PipelineFigures` at scrape time, labelled by tenant and job."""

    def __init__(self, backend: Callable[[], object], db: Database) -> None:
        self._backend = backend
        self._db = db

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        backend = self._backend()
        if not isinstance(backend, PipelineFiguresSource):
            return
        f = backend.pipeline_figures()
        if f is None:
            return
        owners = self._owners(set(f.job_steps) | set(f.waiting_requests))

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        yield gauge(
            "marlaas_device_busy_fraction",
            "Busy fraction of the device since the pipeline started.",
            f.device_busy_fraction,
        )
        yield gauge(
            "marlaas_device_busy_fraction_recent",
            "Busy fraction of the device over the last minute.",
            f.device_busy_fraction_recent,
        )
        busy = CounterMetricFamily(
            "marlaas_stage_busy_seconds", "Device busy time per stage.", labels=["stage"]
        )
        busy.add_metric(["decode"], f.decode_busy_s)
        busy.add_metric(["train"], f.train_busy_s)
        yield busy
        yield counter("marlaas_decode_iterations", "Engine decode iterations.", f.decode_iterations)
        yield counter("marlaas_tokens_sampled", "Tokens generated.", f.tokens_sampled)
        yield counter("marlaas_train_steps", "Multi-lane trainer steps.", f.train_steps)
        yield gauge("marlaas_engine_rows", "Rows in the engine's batch now.", f.engine_rows)
        yield gauge("marlaas_env_active_calls", "Environment calls in flight.", f.env_active)
        env = CounterMetricFamily(
            "marlaas_env_calls", "Environment calls by outcome.", labels=["outcome"]
        )
        env.add_metric(["all"], f.env_calls)
        env.add_metric(["error"], f.env_errors)
        env.add_metric(["timeout"], f.env_timeouts)
        yield env
        labels = ["tenant", "job"]
        waiting = GaugeMetricFamily(
            "marlaas_queue_waiting_requests",
            "Generation requests waiting for the engine (queue depth).",
            labels=labels,
        )
        for job, n in sorted(f.waiting_requests.items()):
            waiting.add_metric([owners.get(job, ""), job], n)
        yield waiting
        steps = GaugeMetricFamily(
            "marlaas_job_steps_trained", "Optimizer steps a job has taken.", labels=labels
        )
        stale = GaugeMetricFamily(
            "marlaas_job_staleness_max", "Highest staleness a job has trained on.", labels=labels
        )
        for job, n in sorted(f.job_steps.items()):
            steps.add_metric([owners.get(job, ""), job], n)
            stale.add_metric([owners.get(job, ""), job], f.job_staleness_max.get(job, 0))
        yield steps
        yield stale
        tokens = CounterMetricFamily(
            "marlaas_job_tokens_generated",
            "Tokens a job's sampling generated (rollouts, evals and its graders' judge calls).",
            labels=labels,
        )
        for job, n in sorted(f.job_tokens.items()):
            tokens.add_metric([owners.get(job, ""), job], n)
        yield tokens

    def _owners(self, job_ids: set[str]) -> dict[str, str]:
        if not job_ids:
            return {}
        with self._db.transaction() as session:
            rows = session.execute(
                select(Job.id, Tenant.name)
                .join(Tenant, Tenant.id == Job.tenant_id)
                .where(Job.id.in_(job_ids))
            ).all()
        return {job: tenant for job, tenant in rows}


class RequestMetrics:
    """HTTP request latency histogram, labelled by route template (not raw path, so ids
    do not explode the label set)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.latency = Histogram(
            "marlaas_http_request_duration_seconds",
            "HTTP request latency by method, route and status code.",
            labelnames=["method", "route", "status"],
            registry=registry,
        )


def make_registry(db: Database) -> tuple[CollectorRegistry, RequestMetrics]:
    registry = CollectorRegistry()
    registry.register(JobCounts(db))
    return registry, RequestMetrics(registry)
