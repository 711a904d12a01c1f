"""Dataset uploads: JSONL checked while streaming, size quota and limit, referenced by
name from a job (never a server path), invisible to other tenants, protected while in
use."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi.testclient import TestClient

from helpers.service_support import ScriptedBackend, Tenants

ROWS = b"".join(
    json.dumps({"prompt": f"{i}+1=", "reference": str(i + 1)}).encode() + b"\n" for i in range(20)
)


def _dataset_job(name: str, dataset: str) -> dict[str, object]:
    return {
        "name": name,
        "steps": 2,
        "task": {"type": "dataset", "path": dataset, "grader": {"type": "exact"}},
    }


def test_upload_and_run_a_dataset_job(
    client: TestClient, tenants: Tenants, backend: ScriptedBackend
) -> None:
    acme, globex = tenants.create("acme"), tenants.create("globex")
    r = client.put("/v1/datasets/sums", content=ROWS, headers=acme)
    assert r.status_code == 201, r.text
    assert r.json()["rows"] == 20 and r.json()["size_bytes"] == len(ROWS)
    listed = client.get("/v1/datasets", headers=acme).json()["datasets"]
    assert [d["name"] for d in listed] == ["sums"]
    assert client.get("/v1/datasets", headers=globex).json()["datasets"] == []

    backend.hold_at = 1
    job = client.post("/v1/jobs", json=_dataset_job("d1", "sums"), headers=acme).json()
    assert job["spec"]["task"]["path"] == "sums"  # what the tenant wrote
    given = Path(backend.specs[job["id"]].task.path)  # type: ignore[union-attr]
    assert given.is_absolute() and given.read_bytes() == ROWS  # what the backend runs
    # another tenant cannot name acme's dataset
    r = client.post("/v1/jobs", json=_dataset_job("d1", "sums"), headers=globex)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "task", "path"]
    # in use: neither replaced nor deleted
    assert client.put("/v1/datasets/sums", content=ROWS, headers=acme).status_code == 409
    r = client.delete("/v1/datasets/sums", headers=acme)
    assert r.status_code == 409 and "d1" in r.json()["detail"]
    client.post(f"/v1/jobs/{job['id']}/cancel", headers=acme)
    assert client.delete("/v1/datasets/sums", headers=acme).status_code == 204
    assert not given.exists()
    assert client.get("/v1/me", headers=acme).json()["usage"]["dataset_bytes"] == 0


def test_bad_jsonl_is_refused_with_its_line(client: TestClient, tenants: Tenants) -> None:
    acme = tenants.create("acme")
    r = client.put("/v1/datasets/x", content=b'{"a": 1}\n[1, 2]\n', headers=acme)
    assert r.status_code == 422 and "line 2" in r.json()["detail"][0]["msg"]
    r = client.put("/v1/datasets/x", content=b'{"a": 1}\n{"b": \n', headers=acme)
    assert r.status_code == 422 and "line 2 is not valid JSON" in r.json()["detail"][0]["msg"]
    assert client.put("/v1/datasets/x", content=b"\n\n", headers=acme).status_code == 422
    assert client.put("/v1/datasets/bad%20name", content=ROWS, headers=acme).status_code == 422
    assert client.get("/v1/datasets", headers=acme).json()["datasets"] == []


def test_dataset_quota_and_upload_limit(client: TestClient, tenants: Tenants) -> None:
    acme = tenants.create("acme", max_dataset_bytes=len(ROWS) + 10)
    assert client.put("/v1/datasets/a", content=ROWS, headers=acme).status_code == 201
    r = client.put("/v1/datasets/b", content=ROWS, headers=acme)
    assert r.status_code == 429
    assert (
        "max_dataset_bytes" in r.json()["detail"]
        and f"limit is {len(ROWS) + 10}" in r.json()["detail"]
    )
    # replacing a dataset gives its own bytes back first
    assert (
        client.put("/v1/datasets/a", content=ROWS[: ROWS.rindex(b"{")], headers=acme).status_code
        == 201
    )
    huge = b'{"p": "' + b"x" * 300_000 + b'"}\n'
    r = client.put("/v1/datasets/h", content=huge, headers=acme)
    assert r.status_code == 413 and "upload" in r.json()["detail"]

    def stream():  # type: ignore[no-untyped-def]
        for _ in range(30):
            yield b'{"p": "' + b"y" * 10_000 + b'"}\n'

    r = client.put("/v1/datasets/h", content=stream(), headers=acme)
    assert r.status_code == 413
    names = [d["name"] for d in client.get("/v1/datasets", headers=acme).json()["datasets"]]
    assert names == ["a"]
    leftovers = list((client.app.state.context.settings.artifact_dir / "datasets").rglob("*"))  # type: ignore[attr-defined]
    assert [p.name for p in leftovers if p.is_file() and p.name.startswith(".upload")] == []
