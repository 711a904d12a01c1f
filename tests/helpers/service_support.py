"""Test helpers: a deterministic scripted backend, tenant/key creation through the
admin API, and job specs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi.testclient import TestClient

from marlaas.config.job import JobSpec
from marlaas.service.lifecycle import JobStatus
from marlaas.service.reporter import JobReporter

ADMIN_KEY = "test-admin-key-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def job_body(name: str = "j1", steps: int = 4, **extra: Any) -> dict[str, Any]:
    return {"name": name, "task": {"family": "arithmetic"}, "steps": steps, **extra}


@dataclass
class ScriptedBackend:
    """Runs jobs by script, entirely inside the awaited call, so that when an API call
    returns the database already shows the outcome (no waiting, no timing).

    `submit` reports running, then steps 1..`hold_at` (all steps when None) with a
    checkpoint every `checkpoint_every` steps and at the last, then done if it reached
    the end. `resume` reports running and plays the rest. `fail_submit` makes submit
    raise. Every call is recorded in `calls`.
    """

    hold_at: int | None = None
    fail_submit: bool = False
    calls: list[tuple[str, str]] = field(default_factory=list)
    specs: dict[str, JobSpec] = field(default_factory=dict)
    done: dict[str, int] = field(default_factory=dict)
    closed: bool = False
    reporter: JobReporter | None = None

    def attach(self, reporter: JobReporter) -> ScriptedBackend:
        self.reporter = reporter
        return self

    @property
    def _reporter(self) -> JobReporter:
        assert self.reporter is not None
        return self.reporter

    async def submit(self, job_id: str, spec: JobSpec) -> None:
        self.calls.append(("submit", job_id))
        if self.fail_submit:
            raise RuntimeError("the scripted backend is full")
        self.specs[job_id] = spec
        self.done[job_id] = 0
        await self._reporter.status(job_id, JobStatus.RUNNING)
        await self._advance(job_id, self.hold_at or spec.steps)

    async def _advance(self, job_id: str, upto: int) -> None:
        spec = self.specs[job_id]
        for step in range(self.done[job_id] + 1, min(upto, spec.steps) + 1):
            metrics = {"reward": step / 10, "loss": 1.0 / step}
            await self._reporter.step(job_id, step, metrics)
            every = spec.checkpoint_every
            if (every and step % every == 0) or step == spec.steps:
                path = self._reporter.artifact_dir / "checkpoints" / job_id / f"step-{step}"
                path.mkdir(parents=True)
                await self._reporter.checkpoint(job_id, step, path, {"reward": step / 10})
            self.done[job_id] = step
        if self.done[job_id] == spec.steps:
            await self._reporter.status(job_id, JobStatus.DONE)

    async def cancel(self, job_id: str) -> None:
        self.calls.append(("cancel", job_id))

    async def pause(self, job_id: str) -> None:
        self.calls.append(("pause", job_id))

    async def unpause(self, job_id: str) -> None:
        self.calls.append(("resume", job_id))
        await self._reporter.status(job_id, JobStatus.RUNNING)
        await self._advance(job_id, self.specs[job_id].steps)

    async def close(self) -> None:
        self.closed = True


@dataclass
class Tenants:
    """Creates tenants and their keys through the admin API."""

    client: TestClient

    def create(self, name: str, **quotas: int) -> dict[str, str]:
        """A new tenant; returns the Authorization header of a fresh key of it."""
        r = self.client.post(
            "/v1/admin/tenants", json={"name": name, "quotas": quotas}, headers=ADMIN
        )
        assert r.status_code == 201, r.text
        return self.key(name)

    def key(self, name: str) -> dict[str, str]:
        r = self.client.post(f"/v1/admin/tenants/{name}/keys", json={}, headers=ADMIN)
        assert r.status_code == 201, r.text
        return {"Authorization": f"Bearer {r.json()['key']}"}
