"""Admission of supervised jobs through the native job API: every row read and
rendered before 201, each within the served model's context, and the step's cost
(`batch_size` sequences of the longest row) bounded by the tenant's quotas."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from helpers.service_support import ADMIN, Tenants

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _rows(n: int, answer: str = "ok") -> str:
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": answer}]
    return "".join(json.dumps({"id": i, "messages": chat}) + "\n" for i in range(n))


def _upload(client: TestClient, headers: dict[str, str], name: str, text: str) -> None:
    r = client.put(f"/v1/datasets/{name}", content=text.encode(), headers=headers)
    assert r.status_code == 201, r.text


def _sft_job(path: str, batch: int = 4) -> dict[str, Any]:
    return {
        "name": "sft",
        "task": {"type": "dataset", "path": path},
        "algorithm": {"type": "sft", "batch_size": batch},
        "steps": 2,
        "eval_episodes": 2,
    }


def _refused(client: TestClient, headers: dict[str, str], body: dict[str, Any]) -> Any:
    r = client.post("/v1/jobs", json=body, headers=headers)
    assert r.status_code in (422, 429), r.text
    assert client.get("/v1/jobs", headers=headers).json()["jobs"] == []  # nothing stored
    return r


def test_a_supervised_step_is_bounded_by_max_tokens_per_step(
    client: TestClient, tenants: Tenants
) -> None:
    acme = tenants.create("acme", max_tokens_per_step=100)
    # Each row renders to about 30 tokens (`Q: hi` / `A: ...` lines): 2 fit, 8 do not.
    _upload(client, acme, "conv", _rows(6, answer="y" * 20))
    assert client.post("/v1/jobs", json=_sft_job("conv", batch=2), headers=acme).status_code == 201
    client.delete("/v1/jobs/sft", headers=acme)
    r = client.post("/v1/jobs", json={**_sft_job("conv", batch=8), "name": "big"}, headers=acme)
    assert r.status_code == 429, r.text
    assert "quota max_tokens_per_step exceeded" in r.json()["detail"]
    client.patch(
        "/v1/admin/tenants/acme/quotas", json={"max_tokens_per_step": 10_000}, headers=ADMIN
    )
    r = client.post("/v1/jobs", json={**_sft_job("conv", batch=8), "name": "big"}, headers=acme)
    assert r.status_code == 201, r.text


def test_supervised_rows_are_checked_before_201(client: TestClient, tenants: Tenants) -> None:
    acme = tenants.create("acme")
    _upload(
        client, acme, "long", _rows(5) + _rows(1, answer="x" * 300).replace('"id": 0', '"id": 9')
    )
    r = _refused(client, acme, _sft_job("long"))
    detail = r.json()["detail"]
    assert detail[0]["loc"] == ["body", "task", "path"]
    message = detail[0]["msg"]
    assert "dataset 'long', line 6" in message and "the served model's context" in message
    bad = _rows(1) + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
    _upload(client, acme, "bad", bad)
    message = _refused(client, acme, _sft_job("bad")).json()["detail"][0]["msg"]
    assert "dataset 'bad', line 2" in message and "no assistant message" in message
    graded = {
        **_sft_job("long"),
        "task": {"type": "dataset", "path": "long", "grader": {"type": "exact"}},
    }
    r = _refused(client, acme, graded)
    assert "a supervised job trains on its rows' own completions" in r.text
