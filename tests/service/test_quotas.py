"""Quotas answer 429 naming the quota and its limit; body limits answer 413; the
admin can change quotas; concurrent requests never overshoot a limit."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from fastapi.testclient import TestClient

from helpers.service_support import ADMIN, ScriptedBackend, Tenants, job_body


def test_concurrent_jobs_quota(
    client: TestClient, tenants: Tenants, backend: ScriptedBackend
) -> None:
    backend.hold_at = 1
    acme = tenants.create("acme", max_concurrent_jobs=2)
    ids = [
        client.post("/v1/jobs", json=job_body(f"j{i}"), headers=acme).json()["id"] for i in range(2)
    ]
    r = client.post("/v1/jobs", json=job_body("j2"), headers=acme)
    assert r.status_code == 429
    detail = r.json()["detail"]
    assert "max_concurrent_jobs" in detail and "limit is 2" in detail
    client.post(f"/v1/jobs/{ids[0]}/cancel", headers=acme)
    assert client.post("/v1/jobs", json=job_body("j2"), headers=acme).status_code == 201
    # the admin raises the limit; the next one fits
    r = client.patch(
        "/v1/admin/tenants/acme/quotas", json={"max_concurrent_jobs": 3}, headers=ADMIN
    )
    assert r.json()["quotas"]["max_concurrent_jobs"] == 3
    assert client.post("/v1/jobs", json=job_body("j3"), headers=acme).status_code == 201


def test_total_steps_quota_gives_back_unused_steps(
    client: TestClient, tenants: Tenants, backend: ScriptedBackend
) -> None:
    backend.hold_at = 5
    acme = tenants.create("acme", max_total_steps=30)
    first = client.post("/v1/jobs", json=job_body("a", steps=20), headers=acme).json()
    r = client.post("/v1/jobs", json=job_body("b", steps=20), headers=acme)
    assert r.status_code == 429
    assert "max_total_steps" in r.json()["detail"] and "limit of 30 (10 left)" in r.json()["detail"]
    # cancelling after 5 steps charges 5, so 25 are free again
    client.post(f"/v1/jobs/{first['id']}/cancel", headers=acme)
    assert client.get("/v1/me", headers=acme).json()["usage"]["total_steps"] == 5
    assert client.post("/v1/jobs", json=job_body("b", steps=20), headers=acme).status_code == 201
    assert client.get("/v1/me", headers=acme).json()["usage"] == {
        "active_jobs": 1,
        "total_steps": 25,
        "dataset_bytes": 0,
    }


def test_request_body_limit_answers_413(client: TestClient, tenants: Tenants) -> None:
    acme = tenants.create("acme")
    big = job_body() | {"padding": "x" * 70_000}
    r = client.post("/v1/jobs", json=big, headers=acme)
    assert r.status_code == 413
    assert "limit of 65536 bytes" in r.json()["detail"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while streaming
        yield b'{"name": "j1", "padding": "'
        for _ in range(10):
            yield b"x" * 10_000
        yield b'"}'

    headers = acme | {"Content-Type": "application/json"}
    r = client.post("/v1/jobs", content=chunks(), headers=headers)
    assert r.status_code == 413 and "limit of 65536 bytes" in r.json()["detail"]
    assert client.get("/v1/jobs", headers=acme).json()["jobs"] == []


def test_concurrent_creates_never_overshoot_the_quota(
    client: TestClient, tenants: Tenants, backend: ScriptedBackend
) -> None:
    backend.hold_at = 1
    acme = tenants.create("acme", max_concurrent_jobs=3)

    def create(i: int) -> int:
        return client.post("/v1/jobs", json=job_body(f"c{i}"), headers=acme).status_code

    with ThreadPoolExecutor(max_workers=8) as pool:
        codes = list(pool.map(create, range(8)))
    assert sorted(codes) == [201] * 3 + [429] * 5
    assert len(client.get("/v1/jobs", headers=acme).json()["jobs"]) == 3
