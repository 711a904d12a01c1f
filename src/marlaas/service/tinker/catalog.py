"""Tinker weights as OpenAI-compatible models: a tenant calls `POST /v1/completions`
with `model` set to one of its `tinker://RUN/sampler_weights/NAME` paths (or a saved
state's `tinker://RUN/weights/NAME`), and `/v1/models` lists its sampler weights.

Resolution goes through the store with the caller's tenant id, so another tenant's path
is "not found" like a missing one. The adapter is served from its PEFT files, under a
bank name of its own (`serve:tinker://...`).
"""

from __future__ import annotations

from pathlib import Path

from marlaas.service.db import Database
from marlaas.service.errors import NotFound
from marlaas.service.models_catalog import ModelNotFound, ServedModel
from marlaas.service.tinker.errors import UserError
from marlaas.service.tinker.paths import TinkerPath
from marlaas.service.tinker.store import CheckpointRecord, TinkerStore


def _served(record: CheckpointRecord) -> ServedModel:
    name = str(record.path)
    return ServedModel(
        name,
        record.created_at,
        job_id=record.path.run_id,
        step=record.version,
        adapter_dir=record.directory,
        serve_key=f"serve:{name}",
    )


def served_model(db: Database, tenant_id: str, name: str, artifact_dir: Path) -> ServedModel:
    """The tenant's weights at the `tinker://` path `name`; `ModelNotFound` otherwise."""
    try:
        path = TinkerPath.parse(name)
        return _served(TinkerStore(db, artifact_dir).checkpoint(tenant_id, path))
    except (UserError, NotFound):
        raise ModelNotFound(
            name, "List your Tinker weights with GET /api/v1/checkpoints."
        ) from None


def served_models(db: Database, tenant_id: str, artifact_dir: Path) -> list[ServedModel]:
    """The tenant's sampler weights, oldest first."""
    saved = TinkerStore(db, artifact_dir).checkpoints(tenant_id, kind="sampler")
    return [_served(r) for r in saved if r.directory.is_dir()]
