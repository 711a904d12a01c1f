"""The job API: create from a validated spec, list, get, the state machine of cancel /
pause / resume against a scripted backend, metrics and checkpoints, tenant isolation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient

from helpers.service_support import ScriptedBackend, Tenants, job_body
from marlaas.config.job import JobSpec


def _create(client: TestClient, headers: dict[str, str], **kw: Any) -> dict[str, Any]:
    r = client.post("/v1/jobs", json=job_body(**kw), headers=headers)
    assert r.status_code == 201, r.text
    out: dict[str, Any] = r.json()
    return out


def test_create_list_get_without_backend(
    make_client: Callable[..., TestClient],
) -> None:
    client = make_client(with_backend=False)
    acme = Tenants(client).create("acme")
    job = _create(client, acme, name="first", steps=7)
    assert job["status"] == "queued" and job["steps"] == 7 and job["steps_done"] == 0
    # The stored spec is the resolved one: every default filled in.
    assert JobSpec.model_validate(job["spec"]).lora.rank == 8
    assert client.get(f"/v1/jobs/{job['id']}", headers=acme).json() == job
    second = _create(client, acme, name="second")
    listed = client.get("/v1/jobs", headers=acme).json()["jobs"]
    assert [j["id"] for j in listed] == [second["id"], job["id"]]
    assert client.get("/v1/jobs?status=running", headers=acme).json()["jobs"] == []
    assert [
        j["name"] for j in client.get("/v1/jobs?status=queued&limit=1", headers=acme).json()["jobs"]
    ] == ["second"]
    assert client.get("/v1/jobs?status=bogus", headers=acme).status_code == 422
    r = client.post("/v1/jobs", json=job_body(name="first"), headers=acme)
    assert r.status_code == 409 and "first" in r.json()["detail"]


def test_invalid_specs_answer_422_per_field_and_store_nothing(
    client: TestClient, tenants: Tenants
) -> None:
    acme = tenants.create("acme")
    cases: list[tuple[dict[str, Any], list[Any]]] = [
        (job_body(steps=0), ["body", "steps"]),
        (job_body(bogus=1), ["body", "bogus"]),
        (job_body(name="bad name!"), ["body", "name"]),
        ({**job_body(), "task": {"family": "chess"}}, ["body", "task", "family"]),
        (
            {**job_body(), "task": {"family": "arithmetic", "options": {"x": 1}}},
            ["body", "task", "options"],
        ),
        ({**job_body(), "lora": {"rank": 64}}, ["body", "lora", "rank"]),
        (
            {**job_body(), "algorithm": {"max_staleness": 9}},
            ["body", "algorithm", "max_staleness"],
        ),
        (
            {
                **job_body(),
                "task": {"type": "dataset", "path": "/etc/passwd", "grader": {"type": "exact"}},
            },
            ["body", "task", "path"],
        ),
    ]
    for body, loc in cases:
        r = client.post("/v1/jobs", json=body, headers=acme)
        assert r.status_code == 422, (body, r.text)
        detail = r.json()["detail"]
        assert any(d["loc"][: len(loc)] == loc and d["msg"] for d in detail), (loc, detail)
        assert all("input" not in d for d in detail)
    assert client.get("/v1/jobs", headers=acme).json()["jobs"] == []
    assert client.get("/v1/me", headers=acme).json()["usage"]["total_steps"] == 0


def test_job_runs_to_done_with_metrics_and_checkpoints(
    client: TestClient, tenants: Tenants, backend: ScriptedBackend
) -> None:
    acme = tenants.create("acme")
    job = _create(client, acme, steps=4, checkpoint_every=2)
    assert backend.calls == [("submit", job["id"])]
    got = client.get(f"/v1/jobs/{job['id']}", headers=acme).json()
    assert got["status"] == "done" and got["steps_done"] == 4
    ckpts = client.get(f"/v1/jobs/{job['id']}/checkpoints", headers=acme).json()["checkpoints"]
    assert [c["step"] for c in ckpts] == [2, 4]
    assert ckpts[1]["metrics"] == {"reward": 0.4}
    points = client.get(f"/v1/jobs/{job['id']}/metrics", headers=acme).json()["points"]
    assert [(p["step"], p["name"]) for p in points][:3] == [(1, "loss"), (1, "reward"), (2, "loss")]
    assert len(points) == 8
    r = client.get(
        f"/v1/jobs/{job['id']}/metrics",
        params={"name": "reward", "since_step": 2, "until_step": 3},
        headers=acme,
    )
    assert [(p["step"], p["value"]) for p in r.json()["points"]] == [(2, 0.2), (3, 0.3)]
    r = client.post(f"/v1/jobs/{job['id']}/cancel", headers=acme)
    assert r.status_code == 409
    assert "it is done" in r.json()["detail"] and "queued, running" in r.json()["detail"]


def test_pause_resume_cancel_state_machine(
    client: TestClient, tenants: Tenants, backend: ScriptedBackend
) -> None:
    acme = tenants.create("acme")
    backend.hold_at = 2
    job = _create(client, acme, steps=5)
    jid = job["id"]
    got = client.get(f"/v1/jobs/{jid}", headers=acme).json()
    assert (got["status"], got["steps_done"]) == ("running", 2)

    def act(action: str) -> tuple[int, dict[str, Any]]:
        r = client.post(f"/v1/jobs/{jid}/{action}", headers=acme)
        return r.status_code, r.json()

    code, body = act("resume")
    assert code == 409 and "cannot resume" in body["detail"] and "running" in body["detail"]
    code, body = act("pause")
    assert code == 200 and body["status"] == "paused"
    assert act("pause")[0] == 409
    code, body = act("resume")
    assert code == 200 and body["status"] == "queued"  # the backend then reports running
    got = client.get(f"/v1/jobs/{jid}", headers=acme).json()
    assert (got["status"], got["steps_done"]) == ("done", 5)
    assert backend.calls == [("submit", jid), ("pause", jid), ("resume", jid)]

    other = _create(client, acme, name="other", steps=5)
    code, body = act_on(client, acme, other["id"], "cancel")
    assert code == 200 and body["status"] == "cancelled"
    assert act_on(client, acme, other["id"], "resume")[0] == 409
    assert act_on(client, acme, other["id"], "cancel")[0] == 409


def act_on(
    client: TestClient, headers: dict[str, str], jid: str, action: str
) -> tuple[int, dict[str, Any]]:
    r = client.post(f"/v1/jobs/{jid}/{action}", headers=headers)
    return r.status_code, r.json()


def test_a_late_runner_report_never_revives_a_cancelled_job(
    client: TestClient, tenants: Tenants, backend: ScriptedBackend
) -> None:
    import asyncio

    from marlaas.service.lifecycle import JobStatus

    acme = tenants.create("acme")
    backend.hold_at = 1
    jid = _create(client, acme, steps=3)["id"]
    assert act_on(client, acme, jid, "cancel")[1]["status"] == "cancelled"
    assert backend.reporter is not None
    changed = asyncio.run(backend.reporter.status(jid, JobStatus.DONE))
    assert changed is False
    assert client.get(f"/v1/jobs/{jid}", headers=acme).json()["status"] == "cancelled"


def test_backend_error_fails_the_job_with_its_reason(
    client: TestClient, tenants: Tenants, backend: ScriptedBackend
) -> None:
    acme = tenants.create("acme")
    backend.fail_submit = True
    job = _create(client, acme)
    assert job["status"] == "failed"
    assert job["failure_reason"] == "backend error: the scripted backend is full"


def test_other_tenants_jobs_answer_exactly_like_missing_ones(
    client: TestClient, tenants: Tenants, backend: ScriptedBackend
) -> None:
    acme, globex = tenants.create("acme"), tenants.create("globex")
    backend.hold_at = 1
    jid = _create(client, acme, steps=3, checkpoint_every=1)["id"]
    for method, suffix in [
        ("GET", ""),
        ("GET", "/metrics"),
        ("GET", "/checkpoints"),
        ("POST", "/cancel"),
        ("POST", "/pause"),
        ("POST", "/resume"),
    ]:
        theirs = client.request(method, f"/v1/jobs/{jid}{suffix}", headers=globex)
        missing = client.request(method, f"/v1/jobs/job_0000000000000000{suffix}", headers=globex)
        assert theirs.status_code == missing.status_code == 404
        assert theirs.content == missing.content
        assert dict(theirs.headers) == dict(missing.headers)
    assert client.get("/v1/jobs", headers=globex).json()["jobs"] == []
    # acme's job is untouched by globex's attempts
    assert client.get(f"/v1/jobs/{jid}", headers=acme).json()["status"] == "running"
    # and the same job name is free for another tenant
    _create(client, globex, name="j1")


def test_backend_is_closed_at_shutdown(
    make_client: Callable[..., TestClient], backend: ScriptedBackend
) -> None:
    client = make_client()
    assert client.get("/readyz").json()["backend"] == "ScriptedBackend"
    client.__exit__(None, None, None)
    assert backend.closed


def test_a_step_reported_again_replaces_its_metrics(
    client: TestClient, tenants: Tenants, backend: ScriptedBackend
) -> None:
    """After a crash, the steps since the last checkpoint are trained and reported
    again: the metrics keep one value per step and name, the newest."""
    import asyncio

    acme = tenants.create("acme")
    backend.hold_at = 1
    jid = _create(client, acme, steps=3)["id"]
    assert backend.reporter is not None
    asyncio.run(backend.reporter.step(jid, 2, {"reward_mean": 0.25, "loss": 1.0}))
    asyncio.run(backend.reporter.step(jid, 2, {"reward_mean": 0.75}))
    points = client.get(f"/v1/jobs/{jid}/metrics", headers=acme).json()["points"]
    at_2 = sorted((p["name"], p["value"]) for p in points if p["step"] == 2)
    assert at_2 == [("loss", 1.0), ("reward_mean", 0.75)]
