"""Model names a tenant may call for inference, resolved against the database.

Model names (what `model` says in a request, and what `/v1/models` lists):
- `base` -- the plain shared base, no adapter;
- `<job id>` (e.g. `job_3f9a0c1d2e4b5a69`) -- the job's latest adapter: the live one
  while the job trains in the shared engine (the bank tenant named by the job id), else
  its newest checkpoint whose adapter is on disk;
- `<job id>:ckpt-<step>` -- the job's checkpoint at optimizer step `step` (the adapter
  version written at that step);
- `ft:BASE:TENANT:SUFFIX:<job id>[:ckpt-step-<step>]` -- the same, for a job created
  through the OpenAI fine-tuning API (`service.openai_ft.names`).
- `tinker://<run>/sampler_weights/<name>` (or a saved state's `.../weights/<name>`) --
  weights a Tinker client saved (`marlaas.service.tinker.catalog`).

Invariants:
- A name resolves through the database with the caller's tenant id in the query, so
  another tenant's job is "not found" exactly like a job that never existed.
- A checkpoint's adapter is the PEFT directory at its path under the artifact
  directory, or the `adapter/` directory inside it (a tenant checkpoint); a path that
  leaves the artifact directory is never read.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

from sqlalchemy import select

from marlaas.service.db import Database
from marlaas.service.errors import NotFound
from marlaas.service.models import Checkpoint, Job
from marlaas.service.openai_ft.names import FT_PREFIX, alias_of, aliases, job_model_name

BASE_MODEL = "base"
BASE_KEY = "serve:base"
_NAME = re.compile(r"^(?P<job>[A-Za-z0-9_-]{1,32})(?::ckpt-(?P<step>\d{1,9}))?$")
_PEFT_CONFIG = "adapter_config.json"
_CHECKPOINT_ADAPTER = "adapter"


class ModelNotFound(NotFound):
    """The one 404 for a model name: missing, malformed or another tenant's alike."""

    def __init__(self, name: str, hint: str = "") -> None:
        super().__init__(
            f"The model `{name}` does not exist or you do not have access to it. "
            f"{hint or 'List your models with GET /v1/models.'}"
        )
        self.name = name


@dataclass(frozen=True)
class ServedModel:
    """A model name resolved for one tenant: the base, a checkpoint's adapter, or (for
    a job's name while the job trains in the shared engine) the job's live adapter."""

    name: str
    created: datetime | None
    job_id: str | None = None
    step: int | None = None
    adapter_dir: Path | None = None
    live: bool = False
    #: The bank name of an adapter that is not a job checkpoint's (Tinker weights).
    serve_key: str | None = None

    @property
    def key(self) -> str:
        """The adapter's tenant name in the bank."""
        if self.serve_key is not None:
            return self.serve_key
        if self.job_id is None:
            return BASE_KEY
        return self.job_id if self.live else f"serve:{self.job_id}:{self.step}"


def adapter_dir(artifact_dir: Path, path: str) -> Path | None:
    """The PEFT directory of a checkpoint row's `path`, or None when it is not on disk."""
    root = artifact_dir.resolve()
    where = (root / path).resolve()
    if not where.is_relative_to(root):
        return None
    for candidate in (where, where / _CHECKPOINT_ADAPTER):
        if (candidate / _PEFT_CONFIG).is_file():
            return candidate
    return None


def _checkpoint_model(name: str, ckpt: Checkpoint, artifact_dir: Path) -> ServedModel | None:
    found = adapter_dir(artifact_dir, ckpt.path)
    if found is None:
        return None
    return ServedModel(name, ckpt.created_at, ckpt.job_id, ckpt.step, found)


def never_live(job_id: str) -> bool:
    """No job trains live (the default for `live`)."""
    return False


def resolve_model(
    db: Database,
    tenant_id: str,
    name: str,
    artifact_dir: Path,
    live: Callable[[str], bool] = never_live,
) -> ServedModel:
    """The tenant's model called `name` (see the module docstring); `ModelNotFound`
    for anything else. A job's name is its live adapter when `live(job id)` says the
    engine trains it now. Blocking (database and file system)."""
    if name == BASE_MODEL:
        return ServedModel(BASE_MODEL, None)
    if name.startswith("tinker://"):
        # Imported here: the Tinker catalog builds on this module's records.
        from marlaas.service.tinker.catalog import served_model

        return served_model(db, tenant_id, name, artifact_dir)
    plain = name
    if name.startswith(FT_PREFIX):
        plain = job_model_name(db, tenant_id, name) or ""
    match = _NAME.match(plain)
    if match is None:
        raise ModelNotFound(name)
    with db.transaction() as session:
        job = session.scalars(
            select(Job).where(
                Job.id == match["job"], Job.tenant_id == tenant_id, Job.deleted_at.is_(None)
            )
        ).one_or_none()
        if job is None:
            raise ModelNotFound(name)
        if match["step"] is None and live(job.id):
            return ServedModel(name, job.updated_at, job.id, live=True)
        query = select(Checkpoint).where(Checkpoint.job_id == job.id)
        if match["step"] is not None:
            query = query.where(Checkpoint.step == int(match["step"]))
        for ckpt in session.scalars(query.order_by(Checkpoint.step.desc())):
            served = _checkpoint_model(name, ckpt, artifact_dir)
            if served is not None:
                return served
    if match["step"] is not None:
        raise ModelNotFound(name, "That job has no checkpoint at this step with its adapter.")
    raise ModelNotFound(name, "That job has no checkpoint with an adapter yet.")


def list_models(
    db: Database, tenant_id: str, artifact_dir: Path, live: Callable[[str], bool] = never_live
) -> list[ServedModel]:
    """`base`, then per job of the tenant (oldest first) that has a servable checkpoint
    or trains live: the job's name (its latest adapter) and each checkpoint by step,
    each followed by its `ft:` name for an OpenAI fine-tuning job."""
    out = [ServedModel(BASE_MODEL, None)]
    with db.transaction() as session:
        jobs = session.execute(
            select(Job.id, Job.updated_at)
            .where(Job.tenant_id == tenant_id, Job.deleted_at.is_(None))
            .order_by(Job.created_at, Job.id)
        ).all()
        rows = session.execute(
            select(Checkpoint)
            .join(Job, Checkpoint.job_id == Job.id)
            .where(Job.tenant_id == tenant_id, Job.deleted_at.is_(None))
            .order_by(Checkpoint.step)
        ).scalars()
        by_job: dict[str, list[ServedModel]] = {}
        for ckpt in rows:
            served = _checkpoint_model(f"{ckpt.job_id}:ckpt-{ckpt.step}", ckpt, artifact_dir)
            if served is not None:
                by_job.setdefault(ckpt.job_id, []).append(served)
        ft_names = aliases(session, tenant_id)
    for job_id, updated in jobs:
        checkpoints = by_job.get(job_id, [])
        mine: list[ServedModel] = []
        if live(job_id):
            mine.append(ServedModel(job_id, updated, job_id, live=True))
        elif checkpoints:
            mine.append(replace(checkpoints[-1], name=job_id))
        mine.extend(checkpoints)
        ft_name = ft_names.get(job_id)
        for m in mine:
            out.append(m)
            if ft_name is not None:
                out.append(replace(m, name=alias_of(m.name, job_id, ft_name)))
    from marlaas.service.tinker.catalog import served_models

    return out + served_models(db, tenant_id, artifact_dir)
