"""Adapter downloads: a checkpoint's (or the newest) adapter as a .tar.gz or .zip of a
PEFT directory that PEFT loads on the embedded base; 404 for other tenants, missing
checkpoints, and anything that resolves outside the artifact directory."""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from peft import PeftModel
from sqlalchemy import update

from helpers.live_support import ADAPTER_SPEC, AdapterBackend, adapter_at
from helpers.service_support import ScriptedBackend, Tenants, job_body
from marlaas.client.download import unpack
from marlaas.model.base import default_base_path, load_base
from marlaas.service.context import ServiceContext
from marlaas.service.models import Checkpoint


@pytest.fixture
def backend() -> ScriptedBackend:
    """Overrides conftest's: checkpoints hold real PEFT adapters."""
    return AdapterBackend()


def _create(client: TestClient, headers: dict[str, str], **kw: Any) -> str:
    r = client.post("/v1/jobs", json=job_body(**kw), headers=headers)
    assert r.status_code == 201, r.text
    jid: str = r.json()["id"]
    return jid


def _unpacked(content: bytes, fmt: str, tmp_path: Path, name: str) -> Path:
    archive = tmp_path / f"{name}.{fmt}"
    archive.write_bytes(content)
    return unpack(archive, fmt, tmp_path / name)


def test_checkpoint_adapter_downloads_as_a_peft_directory_peft_loads(
    client: TestClient, tenants: Tenants, tmp_path: Path
) -> None:
    acme = tenants.create("acme")
    jid = _create(client, acme, name="math", steps=4, checkpoint_every=2)
    r = client.get(f"/v1/jobs/{jid}/checkpoints/2/adapter", headers=acme)
    assert r.status_code == 200, r.text
    assert r.headers["x-marlaas-step"] == "2"
    assert 'filename="math-step-2.tar.gz"' in r.headers["content-disposition"]
    with tarfile.open(fileobj=io.BytesIO(r.content), mode="r:gz") as tf:
        assert sorted(tf.getnames()) == [
            "math-step-2",
            "math-step-2/adapter_config.json",
            "math-step-2/adapter_model.safetensors",
        ]
    folder = _unpacked(r.content, "tar.gz", tmp_path, "step2")

    base, _ = load_base(default_base_path())
    ids = torch.tensor([[5, 9, 17, 33, 2]])
    with torch.no_grad():
        plain = base(input_ids=ids).logits
    model = PeftModel.from_pretrained(base, str(folder))
    with torch.no_grad():
        tuned = model(input_ids=ids).logits
    assert (tuned - plain).abs().max() > 1e-4  # the adapter is really applied
    weights = dict(model.named_parameters())
    path, (A, B) = next(iter(adapter_at(2).items()))
    assert torch.equal(weights[f"base_model.model.{path}.lora_A.default.weight"], A)
    assert torch.equal(weights[f"base_model.model.{path}.lora_B.default.weight"], B)
    assert model.peft_config["default"].r == ADAPTER_SPEC.rank


def test_latest_adapter_and_zip_format(
    client: TestClient, tenants: Tenants, tmp_path: Path
) -> None:
    acme = tenants.create("acme")
    jid = _create(client, acme, steps=3, checkpoint_every=2)
    latest = client.get(f"/v1/jobs/{jid}/adapter", headers=acme)
    assert latest.status_code == 200 and latest.headers["x-marlaas-step"] == "3"
    as_zip = client.get(f"/v1/jobs/{jid}/checkpoints/3/adapter?format=zip", headers=acme)
    assert as_zip.status_code == 200 and as_zip.headers["content-type"] == "application/zip"
    assert zipfile.ZipFile(io.BytesIO(as_zip.content)).testzip() is None
    a = _unpacked(latest.content, "tar.gz", tmp_path, "a")
    b = _unpacked(as_zip.content, "zip", tmp_path, "b")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    bad = client.get(f"/v1/jobs/{jid}/adapter?format=rar", headers=acme)
    assert bad.status_code == 422


def test_missing_checkpoints_and_other_tenants_answer_404(
    client: TestClient, tenants: Tenants, backend: ScriptedBackend
) -> None:
    acme, globex = tenants.create("acme"), tenants.create("globex")
    jid = _create(client, acme, steps=2)
    for suffix in ("/adapter", "/checkpoints/2/adapter"):
        theirs = client.get(f"/v1/jobs/{jid}{suffix}", headers=globex)
        missing = client.get(f"/v1/jobs/job_0000000000000000{suffix}", headers=globex)
        assert theirs.status_code == missing.status_code == 404
        assert theirs.content == missing.content
    r = client.get(f"/v1/jobs/{jid}/checkpoints/7/adapter", headers=acme)
    assert r.status_code == 404 and "no checkpoint at step 7" in r.json()["detail"]
    backend.hold_at = 1
    fresh = _create(client, acme, name="fresh", steps=5, checkpoint_every=4)
    r = client.get(f"/v1/jobs/{fresh}/adapter", headers=acme)
    assert r.status_code == 404 and "no checkpoint yet" in r.json()["detail"]


def test_paths_outside_the_artifact_directory_are_never_served(
    client: TestClient, tenants: Tenants, context: ServiceContext, tmp_path: Path
) -> None:
    acme = tenants.create("acme")
    jid = _create(client, acme, steps=2)
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "adapter_config.json").write_text("{}")
    (secret / "adapter_model.safetensors").write_text("not yours")
    with context.db.transaction() as session:
        session.execute(
            update(Checkpoint).where(Checkpoint.job_id == jid).values(path="../../secret")
        )
    r = client.get(f"/v1/jobs/{jid}/adapter", headers=acme)
    assert r.status_code == 404 and "not on disk" in r.json()["detail"]

    # a symlink inside the checkpoint that points outside is refused as well
    ckpt = context.settings.artifact_dir / "checkpoints" / jid / "step-2"
    weights = ckpt / "adapter" / "adapter_model.safetensors"
    weights.unlink()
    weights.symlink_to(secret / "adapter_model.safetensors")
    with context.db.transaction() as session:
        relative = ckpt.relative_to(context.settings.artifact_dir).as_posix()
        session.execute(update(Checkpoint).where(Checkpoint.job_id == jid).values(path=relative))
    r = client.get(f"/v1/jobs/{jid}/adapter", headers=acme)
    assert r.status_code == 404 and b"not yours" not in r.content
