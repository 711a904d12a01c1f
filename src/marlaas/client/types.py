"""The SDK's view of the API's answers: typed, and tolerant of fields a newer server
adds (they are ignored), so an older client keeps working."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict

from marlaas.config.job import JobSpec

TERMINAL = frozenset({"done", "failed", "cancelled"})


class Answer(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class Job(Answer):
    id: str
    name: str
    status: str
    """queued, running, paused, done, failed or cancelled."""
    steps: int
    steps_done: int
    priority: float
    failure_reason: str | None = None
    created_at: datetime
    updated_at: datetime
    spec: dict[str, Any]

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @property
    def job_spec(self) -> JobSpec:
        return JobSpec.model_validate(self.spec)


class Checkpoint(Answer):
    step: int
    """The optimizer step, which is also the adapter version."""
    metrics: dict[str, float | None]
    created_at: datetime


class MetricPoint(Answer):
    step: int
    name: str
    value: float | None
    time: datetime


class JobEvent(Answer):
    """One event of a job's stream: kind `status` (data: status, reason/action),
    `step` (data: step, metrics) or `checkpoint` (data: step, metrics)."""

    id: int
    job_id: str
    kind: str
    time: datetime
    data: dict[str, Any]
