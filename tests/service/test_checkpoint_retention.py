"""A job's `keep_checkpoints`: only the newest that many checkpoints stay, as rows and
as folders (rows go first, in the transaction that records the new one); a folder a
crash left behind, reported again, is removed rather than recorded; without it every
checkpoint stays."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from helpers.live_support import AdapterBackend
from helpers.service_support import ScriptedBackend, Tenants, job_body
from marlaas.service.context import ServiceContext
from marlaas.service.deletion import checkpoint_folder


@pytest.fixture
def backend() -> ScriptedBackend:
    """Overrides conftest's: checkpoints hold real PEFT adapters, so they are served."""
    return AdapterBackend()


def _create(client: TestClient, headers: dict[str, str], **kw: Any) -> str:
    r = client.post("/v1/jobs", json=job_body(**kw), headers=headers)
    assert r.status_code == 201, r.text
    jid: str = r.json()["id"]
    return jid


def _steps(client: TestClient, headers: dict[str, str], jid: str) -> list[int]:
    r = client.get(f"/v1/jobs/{jid}/checkpoints", headers=headers)
    return [c["step"] for c in r.json()["checkpoints"]]


def _on_disk(context: ServiceContext, jid: str) -> list[str]:
    return sorted(p.name for p in (context.settings.artifact_dir / "checkpoints" / jid).iterdir())


def test_only_the_newest_checkpoints_stay(
    client: TestClient, tenants: Tenants, context: ServiceContext
) -> None:
    acme = tenants.create("acme")
    jid = _create(client, acme, name="kept2", steps=5, checkpoint_every=1, keep_checkpoints=2)
    assert client.get(f"/v1/jobs/{jid}", headers=acme).json()["spec"]["keep_checkpoints"] == 2
    assert _steps(client, acme, jid) == [4, 5]
    assert _on_disk(context, jid) == ["step-4", "step-5"]
    assert client.get(f"/v1/jobs/{jid}/checkpoints/2/adapter", headers=acme).status_code == 404
    assert client.get(f"/v1/jobs/{jid}/checkpoints/4/adapter", headers=acme).status_code == 200
    assert client.get(f"/v1/jobs/{jid}/adapter", headers=acme).headers["x-marlaas-step"] == "5"
    models = [m["id"] for m in client.get("/v1/models", headers=acme).json()["data"]]
    assert models == ["base", jid, f"{jid}:ckpt-4", f"{jid}:ckpt-5"]
    # The history still tells of every checkpoint written.
    r = client.get(f"/v1/jobs/{jid}/events?follow=false", headers=acme)
    assert r.text.count("event: checkpoint") == 5

    every = _create(client, acme, name="all", steps=3, checkpoint_every=1)
    assert _steps(client, acme, every) == [1, 2, 3]
    assert _on_disk(context, every) == ["step-1", "step-2", "step-3"]


def test_a_leftover_folder_reported_again_is_removed_not_recorded(
    client: TestClient, tenants: Tenants, context: ServiceContext
) -> None:
    """A crash between dropping rows and removing folders leaves folders; a resumed
    job's backend reports them again (checkpoints on disk, not in the database)."""
    acme = tenants.create("acme")
    jid = _create(client, acme, name="k1", steps=3, checkpoint_every=1, keep_checkpoints=1)
    assert _steps(client, acme, jid) == [3]
    leftover = context.settings.artifact_dir / "checkpoints" / jid / "step-1"
    (leftover / "adapter").mkdir(parents=True)
    asyncio.run(context.reporter.checkpoint(jid, 1, leftover, {}))
    assert not leftover.exists()
    assert _steps(client, acme, jid) == [3] and _on_disk(context, jid) == ["step-3"]


def test_keep_checkpoints_is_validated(client: TestClient, tenants: Tenants) -> None:
    acme = tenants.create("acme")
    for bad in (0, -1, "x"):
        r = client.post("/v1/jobs", json=job_body(keep_checkpoints=bad), headers=acme)
        assert r.status_code == 422
        assert any(d["loc"][-1] == "keep_checkpoints" for d in r.json()["detail"]), r.text


def test_checkpoint_folder_is_the_checkpoints_own(tmp_path: Path) -> None:
    root = tmp_path / "a"
    jid = "job_0123456789abcdef"
    inside = root.resolve()
    pipeline = f"pipeline/tenants/{jid}/checkpoints/ckpt-00000002/adapter"
    assert checkpoint_folder(root, jid, pipeline) == inside / pipeline.removesuffix("/adapter")
    assert checkpoint_folder(root, jid, f"checkpoints/{jid}/step-2") == (
        inside / "checkpoints" / jid / "step-2"
    )
    for bad in (f"pipeline/tenants/{jid}/adapter", "..", "../x", ".", "adapter"):
        assert checkpoint_folder(root, jid, bad) is None, bad
