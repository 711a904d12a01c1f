"""Probes, Prometheus metrics and the OpenAPI document."""

from __future__ import annotations

from fastapi.testclient import TestClient
from service_support import ScriptedBackend, Tenants, job_body


def test_probes(client: TestClient, context: object) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"


def test_prometheus_metrics(client: TestClient, tenants: Tenants, backend: ScriptedBackend) -> None:
    acme = tenants.create("acme")
    tenants.create("globex")
    backend.hold_at = 1
    client.post("/v1/jobs", json=job_body("a"), headers=acme)
    client.post("/v1/jobs", json=job_body("b"), headers=acme)
    backend.hold_at = None
    client.post("/v1/jobs", json=job_body("c"), headers=acme)
    text = client.get("/metrics").text
    assert 'marlaas_jobs{status="running",tenant="acme"} 2.0' in text
    assert 'marlaas_jobs{status="done",tenant="acme"} 1.0' in text
    assert 'marlaas_jobs{status="queued",tenant="globex"} 0.0' in text
    assert (
        'marlaas_http_request_duration_seconds_count{method="POST",route="/v1/jobs",status="201"} 3.0'
        in text
    )
    # routes are labelled by template, never by raw id
    client.get("/v1/jobs/job_0123456789abcdef", headers=acme)
    assert 'route="/v1/jobs/{job_id}",status="404"' in client.get("/metrics").text


def test_openapi_documents_the_api(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    paths = doc["paths"]
    for path in [
        "/v1/jobs",
        "/v1/jobs/{job_id}",
        "/v1/jobs/{job_id}/cancel",
        "/v1/jobs/{job_id}/pause",
        "/v1/jobs/{job_id}/resume",
        "/v1/jobs/{job_id}/metrics",
        "/v1/jobs/{job_id}/checkpoints",
        "/v1/datasets/{name}",
        "/v1/admin/tenants",
        "/v1/admin/tenants/{name}/quotas",
        "/v1/admin/tenants/{name}/keys",
        "/v1/admin/keys/{key_id}/revoke",
        "/healthz",
        "/readyz",
        "/metrics",
    ]:
        assert path in paths, path
    assert "HTTPBearer" in doc["components"]["securitySchemes"]
    assert "JobSpec" in str(paths["/v1/jobs"]["post"]["requestBody"])
