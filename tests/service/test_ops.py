"""Probes, Prometheus metrics and the OpenAPI document."""

from __future__ import annotations

from fastapi.testclient import TestClient

from helpers.service_support import ADMIN, ScriptedBackend, Tenants, job_body
from marlaas.service.app import create_app, open_context
from marlaas.service.settings import ServiceSettings


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
    text = client.get("/metrics", headers=ADMIN).text
    assert 'marlaas_jobs{status="running",tenant="acme"} 2.0' in text
    assert 'marlaas_jobs{status="done",tenant="acme"} 1.0' in text
    assert 'marlaas_jobs{status="queued",tenant="globex"} 0.0' in text
    assert (
        'marlaas_http_request_duration_seconds_count{method="POST",route="/v1/jobs",status="201"} 3.0'
        in text
    )
    # routes are labelled by template, never by raw id
    client.get("/v1/jobs/job_0123456789abcdef", headers=acme)
    assert 'route="/v1/jobs/{job_id}",status="404"' in client.get("/metrics", headers=ADMIN).text


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


def test_metrics_need_the_admin_key_or_the_metrics_token(
    settings: ServiceSettings,
) -> None:
    """The figures name every tenant and job: no key answers 401, a tenant's key 403
    (so a tenant never sees another's names), the admin key and the metrics token 200."""
    token = "scrape-token-0123456789"
    ctx, _ = open_context(settings.model_copy(update={"metrics_token": token}))
    with TestClient(create_app(ctx)) as client:
        acme = Tenants(client).create("acme")
        Tenants(client).create("globex")
        assert client.get("/metrics").status_code == 401
        as_tenant = client.get("/metrics", headers=acme)
        assert as_tenant.status_code == 403 and "globex" not in as_tenant.text
        for headers in (ADMIN, {"Authorization": f"Bearer {token}"}):
            r = client.get("/metrics", headers=headers)
            assert r.status_code == 200 and 'tenant="globex"' in r.text
        wrong = client.get("/metrics", headers={"Authorization": f"Bearer {token}x"})
        assert wrong.status_code == 401
