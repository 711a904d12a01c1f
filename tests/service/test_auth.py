"""Authentication and keys: every request needs a valid key, admin and tenant keys
reach only their own endpoints, keys are stored hashed and can be revoked."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event, text

from helpers.service_support import ADMIN, Tenants
from marlaas.service import auth
from marlaas.service.app import open_context
from marlaas.service.context import ServiceContext
from marlaas.service.settings import ServiceSettings


def test_requests_without_a_valid_key_are_refused(client: TestClient, tenants: Tenants) -> None:
    tenants.create("acme")
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Bearer mk_x_y"}):
        r = client.get("/v1/jobs", headers=headers)
        assert r.status_code == 401
        assert r.headers["www-authenticate"] == "Bearer"
        assert "API key" in r.json()["detail"]
    assert client.get("/v1/admin/tenants").status_code == 401


def test_admin_and_tenant_keys_reach_only_their_endpoints(
    client: TestClient, tenants: Tenants
) -> None:
    acme = tenants.create("acme")
    r = client.get("/v1/jobs", headers=ADMIN)
    assert r.status_code == 403
    assert "tenant's API key" in r.json()["detail"]
    r = client.get("/v1/admin/tenants", headers=acme)
    assert r.status_code == 403
    assert client.get("/v1/jobs", headers=acme).status_code == 200
    assert [t["name"] for t in client.get("/v1/admin/tenants", headers=ADMIN).json()] == ["acme"]


def test_keys_are_stored_hashed_and_revocable(
    client: TestClient, tenants: Tenants, context: ServiceContext
) -> None:
    tenants.create("acme")
    r = client.post("/v1/admin/tenants/acme/keys", json={"label": "ci"}, headers=ADMIN)
    issued = r.json()
    secret = issued["key"]
    assert secret.startswith(f"mk_{issued['prefix']}_")
    with context.db.engine.connect() as conn:
        dump = repr(conn.execute(text("SELECT * FROM api_keys")).all())
    assert secret.split("_", 2)[2] not in dump  # only the prefix and a keyed hash
    listed = client.get("/v1/admin/tenants/acme/keys", headers=ADMIN).json()
    assert sorted(k["label"] for k in listed) == ["", "ci"]
    assert all("key" not in k for k in listed)
    no_body = client.post("/v1/admin/tenants/acme/keys", headers=ADMIN)
    assert no_body.status_code == 201 and no_body.json()["label"] == ""

    headers = {"Authorization": f"Bearer {secret}"}
    assert client.get("/v1/jobs", headers=headers).status_code == 200
    r = client.post(f"/v1/admin/keys/{issued['id']}/revoke", headers=ADMIN)
    assert r.status_code == 200 and r.json()["revoked_at"] is not None
    r = client.get("/v1/jobs", headers=headers)
    assert r.status_code == 401 and "revoked" in r.json()["detail"]
    assert client.post("/v1/admin/keys/key_missing/revoke", headers=ADMIN).status_code == 404


def test_admin_key_is_generated_once_and_works(settings: ServiceSettings) -> None:
    generated = settings.model_copy(update={"admin_key": None})
    ctx, key = open_context(generated)
    ctx.db.close()
    assert key is not None and key.startswith("mk_")
    ctx, again = open_context(generated)
    assert again is None  # stored (hashed) from the first start; never shown again
    from marlaas.service.app import create_app

    with TestClient(create_app(ctx)) as client:
        headers = {"Authorization": f"Bearer {key}"}
        r = client.post("/v1/admin/tenants", json={"name": "t1"}, headers=headers)
        assert r.status_code == 201
        assert client.get("/v1/admin/tenants", headers=ADMIN).status_code == 401


def test_a_known_key_is_answered_without_a_database_query(
    client: TestClient, tenants: Tenants, context: ServiceContext
) -> None:
    acme = tenants.create("acme")
    statements: list[str] = []

    def record(conn: object, cursor: object, statement: str, *args: object) -> None:
        statements.append(statement)

    event.listen(context.db.engine, "before_cursor_execute", record)
    try:
        assert client.get("/v1/jobs", headers=acme).status_code == 200
        assert any("api_keys" in s for s in statements)  # first use: looked up
        statements.clear()
        assert client.get("/v1/jobs", headers=acme).status_code == 200
        assert statements and not any("api_keys" in s for s in statements)
    finally:
        event.remove(context.db.engine, "before_cursor_execute", record)


def test_principal_cache_expires_and_never_recaches_a_key_revoked_during_its_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(auth.time, "monotonic", lambda: now[0])
    cache = auth.PrincipalCache(ttl_s=10, capacity=2)
    acme = auth.Principal(tenant_id="t_1", tenant_name="acme")
    cache.put("mk_a_1", acme, cache.generation)
    assert cache.get("mk_a_1") == acme
    now[0] += 10.0  # a revocation by another process shows within the time-to-live
    assert cache.get("mk_a_1") is None

    started = cache.generation  # a lookup reads the database ...
    cache.clear()  # ... while the key is revoked here
    cache.put("mk_a_1", acme, started)
    assert cache.get("mk_a_1") is None

    for token in ("mk_a_1", "mk_b_2", "mk_c_3"):  # least recently used goes first
        cache.put(token, acme, cache.generation)
    assert cache.get("mk_a_1") is None and cache.get("mk_c_3") == acme

    off = auth.PrincipalCache(ttl_s=0)
    off.put("mk_a_1", acme, off.generation)
    assert off.get("mk_a_1") is None
    with pytest.raises(ValueError, match="ttl_s"):
        auth.PrincipalCache(ttl_s=-1)
