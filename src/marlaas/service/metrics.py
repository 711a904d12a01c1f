"""Prometheus figures, in a registry per app (no global state): request latencies by
route, and per-tenant job counts by status, read from the database at scrape time so
they are right even after a restart."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import GaugeMetricFamily
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
                .group_by(Tenant.name, Job.status)
            ).all()
            tenants = session.scalars(select(Tenant.name)).all()
        counts = {(t, s): n for t, s, n in rows}
        for tenant in tenants:
            for status in JobStatus:
                family.add_metric([tenant, str(status)], counts.get((tenant, str(status)), 0))
        yield family


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
