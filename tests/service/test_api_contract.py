"""The API keeps its contract at the edges: integers beyond the database's range are a
422, never a 500; `OPTIONS` and 405 name every method of a path; what the OpenAPI
schema allows is answered (no rule the schema does not state), and every status code
an operation returns is in the schema."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from helpers.service_support import ADMIN, ScriptedBackend, Tenants, job_body

HUGE = "99999999999999999999"  # beyond a 64-bit integer: SQLite raised OverflowError


@pytest.fixture
def job(
    client: TestClient, tenants: Tenants, backend: ScriptedBackend
) -> tuple[str, dict[str, str]]:
    acme = tenants.create("acme")
    r = client.post("/v1/jobs", json=job_body(steps=2), headers=acme)
    assert r.status_code == 201, r.text
    return r.json()["id"], acme


@pytest.mark.parametrize(
    ("path", "headers", "param"),
    [
        ("/v1/jobs?offset=60389860664380844146688", {}, "offset"),
        ("/v1/jobs/{job}/checkpoints/" + HUGE + "/adapter", {}, "step"),
        ("/v1/jobs/{job}/metrics?since_step=" + HUGE, {}, "since_step"),
        ("/v1/jobs/{job}/metrics?until_step=" + HUGE, {}, "until_step"),
        ("/v1/jobs/{job}/events?follow=false&after=" + HUGE, {}, "after"),
        ("/v1/jobs/{job}/events?follow=false", {"Last-Event-ID": HUGE}, "Last-Event-ID"),
    ],
)
def test_integers_beyond_the_database_range_are_refused_not_a_500(
    client: TestClient,
    job: tuple[str, dict[str, str]],
    path: str,
    headers: dict[str, str],
    param: str,
) -> None:
    jid, acme = job
    r = client.get(path.format(job=jid), headers={**acme, **headers})
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"][-1] == param


def test_options_and_405_list_every_method_of_the_path(
    client: TestClient, job: tuple[str, dict[str, str]]
) -> None:
    jid, acme = job
    r = client.options(f"/v1/jobs/{jid}")
    assert r.status_code == 204 and r.headers["allow"] == "DELETE, GET, OPTIONS"
    r = client.patch(f"/v1/jobs/{jid}", headers=acme)
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET, OPTIONS"
    r = client.put("/v1/jobs", headers=acme)
    assert r.status_code == 405 and r.headers["allow"] == "GET, OPTIONS, POST"
    assert client.options("/v1/no-such-thing").status_code == 404


def test_a_dataset_can_be_read_back_as_the_readme_says(
    client: TestClient, tenants: Tenants
) -> None:
    acme = tenants.create("acme")
    body = b'{"prompt": "Q: 1\\nA: ", "reference": "1"}\n'
    assert client.put("/v1/datasets/small", content=body, headers=acme).status_code == 201
    r = client.get("/v1/datasets/small", headers=acme)
    assert r.status_code == 200 and r.json()["rows"] == 1 and r.json()["size_bytes"] == len(body)
    assert client.get("/v1/datasets/other", headers=acme).status_code == 404
    globex = tenants.create("globex")
    assert client.get("/v1/datasets/small", headers=globex).status_code == 404


def test_every_status_an_operation_answers_is_in_its_schema(client: TestClient) -> None:
    paths: dict[str, Any] = client.get("/openapi.json").json()["paths"]
    public = {("/healthz", "get"), ("/readyz", "get")}
    for path, item in paths.items():
        for method, op in item.items():
            codes = set(op["responses"])
            if (path, method) not in public:
                assert {"401", "403"} <= codes, (method, path, codes)
            names_one = "{job_id}" in path or "{name}" in path or "{key_id}" in path
            if names_one and method != "put":  # a PUT creates what it names
                assert "404" in codes, (method, path, codes)
    create = set(paths["/v1/jobs"]["post"]["responses"])
    assert {"201", "409", "422", "429"} <= create
    for route in ("/v1/completions", "/v1/chat/completions"):
        assert {"400", "401", "404", "429"} <= set(paths[route]["post"]["responses"])
    # The rules the schema states (the name's pattern, the bounds) are the server's.
    spec = client.get("/openapi.json").json()["components"]["schemas"]["JobSpec-Input"]
    assert spec["properties"]["name"]["pattern"] == "^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
    # Bounds are JSON Schema's `minimum`/`maximum` everywhere (pydantic writes raw
    # `ge`/`le` keys, which no client understands, for bounds after a validator).
    text = client.get("/openapi.json").text
    assert '"ge":' not in text and '"le":' not in text and '"gt":' not in text
    params = {p["name"]: p for p in paths["/v1/jobs/{job_id}/events"]["get"]["parameters"]}
    assert params["Last-Event-ID"]["schema"] == {
        "type": "integer",
        "minimum": 0,
        "maximum": 2**63 - 1,
    }  # a header is never null


@pytest.mark.parametrize(
    "value", ["Bearer  {key}", "Bearer {key} x", "Bearer\t{key}", "bearer {key}"]
)
def test_a_key_is_accepted_in_one_spelling_only(
    client: TestClient, tenants: Tenants, value: str
) -> None:
    acme = tenants.create("acme")
    key = acme["Authorization"].removeprefix("Bearer ")
    r = client.get("/v1/jobs", headers={"Authorization": value.format(key=key)})
    if value.startswith("bearer "):  # the scheme is case-insensitive (RFC 9110)
        assert r.status_code == 200
    else:
        assert r.status_code == 401 and "malformed" in r.json()["detail"]
    assert client.get("/v1/jobs", headers=acme).status_code == 200
    assert client.get("/v1/admin/tenants", headers=ADMIN).status_code == 200
