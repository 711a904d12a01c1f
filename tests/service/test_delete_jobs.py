"""Deleting a job: only once it is done, failed or cancelled (409 otherwise); its files
are removed and it answers 404 everywhere (like a missing one, and like another
tenant's); the steps it used still count toward the quota; its name is free again; an
uploaded dataset it used stays. A crash between hiding the job and removing its files
leaves a hidden job whose files the next start, or the next delete, removes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from helpers.live_support import AdapterBackend
from helpers.service_support import ADMIN, ScriptedBackend, Tenants, job_body
from marlaas.service import jobs as ops
from marlaas.service.context import ServiceContext
from marlaas.service.deletion import job_dirs, purge_deleted_jobs
from marlaas.service.lifecycle import JobStatus
from marlaas.service.models import Checkpoint, Job, JobEvent, Metric

MISSING = "no such job; list your jobs with GET /v1/jobs"


@pytest.fixture
def backend() -> ScriptedBackend:
    """Overrides conftest's: checkpoints hold real PEFT adapters, so they are served."""
    return AdapterBackend()


def _create(client: TestClient, headers: dict[str, str], **kw: Any) -> str:
    r = client.post("/v1/jobs", json=job_body(**kw), headers=headers)
    assert r.status_code == 201, r.text
    jid: str = r.json()["id"]
    return jid


def _job_urls(jid: str) -> list[str]:
    return [
        f"/v1/jobs/{jid}",
        f"/v1/jobs/{jid}/metrics",
        f"/v1/jobs/{jid}/checkpoints",
        f"/v1/jobs/{jid}/events?follow=false",
        f"/v1/jobs/{jid}/adapter",
        f"/v1/jobs/{jid}/checkpoints/2/adapter",
        f"/v1/models/{jid}",
        f"/v1/models/{jid}:ckpt-2",
    ]


def _files(context: ServiceContext, jid: str) -> Path:
    return context.settings.artifact_dir / "checkpoints" / jid


def _pipeline_dir(context: ServiceContext, jid: str) -> Path:
    """Where `PipelineBackend` would keep the job's files: made by hand here."""
    folder = context.settings.artifact_dir / "pipeline" / "tenants" / jid
    (folder / "adapter").mkdir(parents=True)
    (folder / "adapter" / "adapter_model.safetensors").write_bytes(b"x")
    return folder


def _rows(context: ServiceContext, jid: str) -> dict[str, int]:
    with context.db.transaction() as session:
        return {
            table.__tablename__: session.scalar(
                select(func.count()).select_from(table).where(table.job_id == jid)
            )
            or 0
            for table in (Checkpoint, Metric, JobEvent)
        }


def test_delete_a_done_job_removes_its_files_and_hides_it_everywhere(
    client: TestClient, tenants: Tenants, context: ServiceContext
) -> None:
    acme = tenants.create("acme", max_total_steps=10)
    jid = _create(client, acme, name="math", steps=4, checkpoint_every=2)
    kept = _create(client, acme, name="kept", steps=2)
    pipeline = _pipeline_dir(context, jid)
    assert client.get(f"/v1/jobs/{jid}", headers=acme).json()["status"] == "done"
    for url in _job_urls(jid):
        assert client.get(url, headers=acme).status_code == 200, url
    models = [m["id"] for m in client.get("/v1/models", headers=acme).json()["data"]]
    assert jid in models and f"{jid}:ckpt-2" in models
    assert (_files(context, jid) / "step-2" / "adapter").is_dir()
    before = client.get("/v1/me", headers=acme).json()["usage"]
    assert before["total_steps"] == 6

    r = client.delete(f"/v1/jobs/{jid}", headers=acme)
    assert r.status_code == 204 and r.content == b""

    assert not _files(context, jid).exists() and not pipeline.exists()
    assert (_files(context, kept) / "step-2" / "adapter").is_dir()  # the other job's stay
    for url in _job_urls(jid):
        r = client.get(url, headers=acme)
        assert r.status_code == 404, url
    assert client.get(f"/v1/jobs/{jid}", headers=acme).json()["detail"] == MISSING
    assert [j["id"] for j in client.get("/v1/jobs", headers=acme).json()["jobs"]] == [kept]
    models = [m["id"] for m in client.get("/v1/models", headers=acme).json()["data"]]
    assert jid not in " ".join(models) and kept in models
    assert client.delete(f"/v1/jobs/{jid}", headers=acme).status_code == 404  # once only
    assert _rows(context, jid) == {"checkpoints": 0, "metrics": 0, "job_events": 0}
    assert 'tenant="acme"' in client.get("/metrics", headers=ADMIN).text  # still served, without it

    # Quotas: the steps it used still count; deleting gives nothing back.
    assert client.get("/v1/me", headers=acme).json()["usage"] == before
    r = client.post("/v1/jobs", json=job_body("math", steps=5), headers=acme)
    assert r.status_code == 429 and "max_total_steps" in r.json()["detail"]
    # ... but its name is free again.
    again = _create(client, acme, name="math", steps=4)
    assert again != jid


def test_only_a_finished_job_can_be_deleted(
    client: TestClient, tenants: Tenants, context: ServiceContext, backend: ScriptedBackend
) -> None:
    acme = tenants.create("acme")
    backend.hold_at = 1
    jid = _create(client, acme, name="held", steps=3, checkpoint_every=1)
    for status in ("running", "paused"):
        if status == "paused":
            assert client.post(f"/v1/jobs/{jid}/pause", headers=acme).status_code == 200
        assert client.get(f"/v1/jobs/{jid}", headers=acme).json()["status"] == status
        r = client.delete(f"/v1/jobs/{jid}", headers=acme)
        assert r.status_code == 409, r.text
        assert f"it is {status}; cancel it first" in r.json()["detail"]
        assert (_files(context, jid) / "step-1" / "adapter").is_dir()
    assert client.post(f"/v1/jobs/{jid}/resume", headers=acme).status_code == 200
    assert client.get(f"/v1/jobs/{jid}", headers=acme).json()["status"] == "done"
    assert client.delete(f"/v1/jobs/{jid}", headers=acme).status_code == 204
    stopped = _create(client, acme, name="stopped", steps=3)
    assert client.post(f"/v1/jobs/{stopped}/cancel", headers=acme).status_code == 200
    assert client.delete(f"/v1/jobs/{stopped}", headers=acme).status_code == 204
    backend.fail_submit = True
    failed = _create(client, acme, name="failed", steps=3)
    assert client.get(f"/v1/jobs/{failed}", headers=acme).json()["status"] == "failed"
    assert client.delete(f"/v1/jobs/{failed}", headers=acme).status_code == 204


def test_a_queued_job_is_409_and_a_cancelled_one_can_go(
    make_client: Callable[..., TestClient],
) -> None:
    client = make_client(with_backend=False)
    acme = Tenants(client).create("acme")
    jid = _create(client, acme, name="waiting")
    r = client.delete(f"/v1/jobs/{jid}", headers=acme)
    assert r.status_code == 409 and "it is queued; cancel it first" in r.json()["detail"]
    client.post(f"/v1/jobs/{jid}/cancel", headers=acme)
    assert client.delete(f"/v1/jobs/{jid}", headers=acme).status_code == 204
    assert client.get(f"/v1/jobs/{jid}", headers=acme).status_code == 404


def test_another_tenants_job_is_404_like_a_missing_one(
    client: TestClient, tenants: Tenants, context: ServiceContext
) -> None:
    acme, globex = tenants.create("acme"), tenants.create("globex")
    jid = _create(client, acme, name="mine", steps=2)
    for target in (jid, "job_0000000000000000"):
        r = client.delete(f"/v1/jobs/{target}", headers=globex)
        assert r.status_code == 404 and r.json()["detail"] == MISSING
    assert client.delete(f"/v1/jobs/{jid}").status_code == 401
    assert client.get(f"/v1/jobs/{jid}", headers=acme).json()["status"] == "done"
    assert (_files(context, jid) / "step-2" / "adapter").is_dir()


def test_a_dataset_the_job_used_stays(client: TestClient, tenants: Tenants) -> None:
    acme = tenants.create("acme")
    rows = b'{"prompt": "1+1=", "reference": "2"}\n' * 4
    assert client.put("/v1/datasets/sums", content=rows, headers=acme).status_code == 201
    body = {
        "name": "d",
        "steps": 2,
        "task": {"type": "dataset", "path": "sums", "grader": {"type": "exact"}},
    }
    jid = client.post("/v1/jobs", json=body, headers=acme).json()["id"]
    assert client.delete(f"/v1/jobs/{jid}", headers=acme).status_code == 204
    listed = client.get("/v1/datasets", headers=acme).json()["datasets"]
    assert [d["name"] for d in listed] == ["sums"]


def _hide(context: ServiceContext, jid: str) -> None:
    """The delete's first half only: what a crash right after its commit leaves."""
    with context.db.transaction() as session:
        tenant_id = session.scalar(select(Job.tenant_id).where(Job.id == jid))
        assert tenant_id is not None
        ops.delete_job(session, tenant_id, jid)


def test_crash_leftovers_are_removed_at_start_and_on_the_next_delete(
    make_client: Callable[..., TestClient],
) -> None:
    client = make_client()
    context: ServiceContext = client.app.state.context  # type: ignore[attr-defined]
    acme = Tenants(client).create("acme")
    first = _create(client, acme, name="first", steps=2)
    second = _create(client, acme, name="second", steps=2)
    third = _create(client, acme, name="third", steps=2)
    pipeline = _pipeline_dir(context, first)

    _hide(context, first)  # crash: the job is hidden, its files are all there
    assert client.get(f"/v1/jobs/{first}", headers=acme).status_code == 404
    assert _files(context, first).is_dir() and pipeline.is_dir()
    assert _rows(context, first)["checkpoints"] == 1

    restarted = make_client()  # the next start removes them
    assert not _files(context, first).exists() and not pipeline.exists()
    assert _rows(context, first)["checkpoints"] == 0
    assert _files(context, second).is_dir()  # a visible job's files stay

    _hide(context, second)  # crash again; this time the next delete cleans up
    assert restarted.delete(f"/v1/jobs/{third}", headers=acme).status_code == 204
    assert not _files(context, second).exists() and not _files(context, third).exists()
    assert purge_deleted_jobs(context.db, context.settings.artifact_dir) == []  # all done


def test_late_reports_about_a_deleted_job_are_ignored_but_its_steps_count(
    client: TestClient, tenants: Tenants, context: ServiceContext
) -> None:
    acme = tenants.create("acme")
    jid2 = _create(client, acme, name="gone", steps=2)
    assert client.delete(f"/v1/jobs/{jid2}", headers=acme).status_code == 204
    used = client.get("/v1/me", headers=acme).json()["usage"]["total_steps"]
    reporter = context.reporter
    path = context.settings.artifact_dir / "checkpoints" / jid2 / "step-9"
    path.mkdir(parents=True)

    async def late() -> None:
        await reporter.step(jid2, 9, {"reward": 1.0})
        await reporter.checkpoint(jid2, 9, path, {})
        assert not await reporter.status(jid2, JobStatus.FAILED)

    asyncio.run(late())
    assert _rows(context, jid2) == {"checkpoints": 0, "metrics": 0, "job_events": 0}
    with context.db.transaction() as session:
        assert session.get(Job, jid2).steps_done == 9  # type: ignore[union-attr]
    # done jobs are charged their asked steps, so the late step changes nothing here
    assert client.get("/v1/me", headers=acme).json()["usage"]["total_steps"] == used
    assert client.get(f"/v1/jobs/{jid2}", headers=acme).status_code == 404


def test_job_dirs_stay_inside_the_artifact_directory(tmp_path: Path) -> None:
    root = tmp_path / "artifacts"
    jid = "job_0123456789abcdef"
    dirs = job_dirs(
        root,
        jid,
        [
            f"pipeline/tenants/{jid}/checkpoints/ckpt-2/adapter",
            f"checkpoints/{jid}/step-2",
            f"checkpoints/{jid}/step-4",
            "elsewhere/ckpt-7",
            "../outside",
            ".",
        ],
    )
    resolved = root.resolve()
    assert dirs == [
        resolved / "checkpoints" / jid,
        resolved / "elsewhere" / "ckpt-7",
        resolved / "pipeline" / "tenants" / jid,
    ]
