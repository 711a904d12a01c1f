"""`tml-` keys: the admin issues them to a tenant; they resolve to that tenant like its
other keys, on the job routes (Bearer) and on the Tinker routes (X-API-Key), and stop
working when revoked. The Tinker routes take no admin key and answer in the SDK's
shapes before any device is needed."""

from __future__ import annotations

from fastapi.testclient import TestClient

from helpers.service_support import ADMIN, ADMIN_KEY, Tenants


def _tml_key(client: TestClient, tenant: str) -> tuple[str, str]:
    r = client.post(
        f"/v1/admin/tenants/{tenant}/keys", json={"label": "sdk", "format": "tml"}, headers=ADMIN
    )
    assert r.status_code == 201, r.text
    return r.json()["key"], r.json()["id"]


def test_tml_keys_resolve_to_their_tenant_everywhere(client: TestClient, tenants: Tenants) -> None:
    tenants.create("acme")
    key, key_id = _tml_key(client, "acme")
    assert key.startswith("tml-")
    me = client.get("/v1/me", headers={"Authorization": f"Bearer {key}"})
    assert me.status_code == 200 and me.json()["tenant"]["name"] == "acme"
    config = client.post(
        "/api/v1/client/config", json={"sdk_version": "0.38.0"}, headers={"X-API-Key": key}
    )
    assert config.status_code == 200, config.text
    flags = config.json()
    assert flags["pjwt_auth_enabled"] is False and flags["proto_compress_fwdbwd"] is False
    # Chunks of forward_backward stay under the service's body limit.
    assert (
        0 < flags["fwdbwd_max_chunk_bytes_count"] < client.app.state.context.settings.max_body_bytes
    )  # type: ignore[attr-defined]
    session = client.post(
        "/api/v1/create_session",
        json={"tags": [], "sdk_version": "0.38.0"},
        headers={"X-API-Key": key},
    )
    assert session.status_code == 200 and session.json()["session_id"].startswith("ses_")
    beat = client.post(
        "/api/v1/session_heartbeat",
        json={"session_id": session.json()["session_id"]},
        headers={"X-API-Key": key},
    )
    assert beat.json() == {"type": "session_heartbeat"}
    revoked = client.post(f"/v1/admin/keys/{key_id}/revoke", headers=ADMIN)
    assert revoked.status_code == 200
    again = client.post("/api/v1/client/config", json={}, headers={"X-API-Key": key})
    assert again.status_code == 401 and "revoked" in again.json()["detail"]


def test_tinker_routes_refuse_missing_bad_and_admin_keys(
    client: TestClient, tenants: Tenants
) -> None:
    assert client.post("/api/v1/create_session", json={}).status_code == 401
    bad = client.post("/api/v1/create_session", json={}, headers={"X-API-Key": "tml-nope_x"})
    assert bad.status_code == 401
    admin = client.post("/api/v1/create_session", json={}, headers={"X-API-Key": ADMIN_KEY})
    assert admin.status_code == 403 and "tenant" in admin.json()["detail"]


def test_another_tenants_session_and_futures_are_not_found(
    client: TestClient, tenants: Tenants
) -> None:
    tenants.create("a")
    tenants.create("b")
    key_a, _ = _tml_key(client, "a")
    key_b, _ = _tml_key(client, "b")
    sid = client.post("/api/v1/create_session", json={}, headers={"X-API-Key": key_a}).json()[
        "session_id"
    ]
    foreign = client.post(
        "/api/v1/session_heartbeat", json={"session_id": sid}, headers={"X-API-Key": key_b}
    )
    assert foreign.status_code == 404
    missing = client.post(
        "/api/v1/retrieve_future", json={"request_id": "req_0"}, headers={"X-API-Key": key_a}
    )
    assert missing.status_code == 404
    finish = client.post(
        f"/api/v1/sessions/{sid}/finish",
        json={"reason": {"type": "success"}},
        headers={"X-API-Key": key_a},
    )
    assert finish.status_code == 200
    gone = client.post(
        "/api/v1/session_heartbeat", json={"session_id": sid}, headers={"X-API-Key": key_a}
    )
    assert gone.status_code == 410  # the SDK stops its heartbeats on 410
