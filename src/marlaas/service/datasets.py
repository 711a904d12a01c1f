"""Uploaded datasets: a tenant's JSONL files, checked while they stream in, stored under
the artifact directory, and referenced by name from a job's `task.path`.

A tenant never names a server path: `task.path` is the name of one of its own uploads,
and only the service turns that name into a file (`resolve_spec`). Each upload goes to
a new file, so a failed upload never damages the dataset it would replace; a dataset
that an active job uses can be neither replaced nor deleted.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from marlaas.config.job import DatasetSpec, JobSpec
from marlaas.service import quotas
from marlaas.service.errors import Conflict, InvalidField, NotFound, PayloadTooLarge
from marlaas.service.lifecycle import ACTIVE
from marlaas.service.models import Dataset, Job, Tenant, new_id, utcnow


@dataclass(frozen=True)
class Upload:
    """A complete, checked upload in a temporary file."""

    tmp_path: Path
    size_bytes: int
    rows: int
    sha256: str


class _JsonlChecker:
    """Checks JSONL incrementally: every non-blank line must be a JSON object."""

    def __init__(self) -> None:
        self.rows = 0
        self._line_no = 0
        self._partial = b""

    def feed(self, chunk: bytes) -> None:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            self._line(line)

    def finish(self) -> None:
        if self._partial:
            self._line(self._partial)
        if self.rows == 0:
            raise InvalidField(("body",), "the dataset is empty; send one JSON object per line")

    def _line(self, line: bytes) -> None:
        self._line_no += 1
        if not line.strip():
            return
        try:
            row = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InvalidField(
                ("body", self._line_no), f"line {self._line_no} is not valid JSON: {e}"
            ) from None
        if not isinstance(row, dict):
            raise InvalidField(
                ("body", self._line_no),
                f"line {self._line_no} is a JSON {type(row).__name__}; each line must be "
                'an object such as {"prompt": "...", "reference": "..."}',
            )
        self.rows += 1


async def receive(chunks: AsyncIterator[bytes], tmp_path: Path, max_bytes: int) -> Upload:
    """Stream `chunks` into `tmp_path`, checking size and JSONL as they come."""
    checker = _JsonlChecker()
    digest = hashlib.sha256()
    size = 0
    tmp_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with tmp_path.open("wb") as f:
            async for chunk in chunks:
                size += len(chunk)
                if size > max_bytes:
                    raise PayloadTooLarge(
                        f"the upload is larger than this service's limit of {max_bytes} "
                        "bytes; split the dataset or ask the admin to raise max_upload_bytes"
                    )
                checker.feed(chunk)
                digest.update(chunk)
                await asyncio.to_thread(f.write, chunk)
        checker.finish()
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    return Upload(tmp_path=tmp_path, size_bytes=size, rows=checker.rows, sha256=digest.hexdigest())


def _check_unused(session: Session, tenant_id: str, name: str, doing: str) -> None:
    active = session.scalars(
        select(Job).where(Job.tenant_id == tenant_id, Job.status.in_(list(ACTIVE)))
    ).all()
    users = [
        j.name
        for j in active
        if j.spec.get("task", {}).get("type") == "dataset"
        and name in (j.spec["task"].get("path"), j.spec["task"].get("eval_path"))
    ]
    if users:
        raise Conflict(
            f"cannot {doing} dataset {name!r}: active job(s) {', '.join(sorted(users))} use "
            "it; cancel them or wait for them to finish first"
        )


def tenant_dir(artifact_dir: Path, tenant_id: str) -> Path:
    return artifact_dir / "datasets" / tenant_id


def check_quota(session: Session, tenant_id: str, name: str, size_bytes: int) -> None:
    """The quota check of an upload of `size_bytes` as dataset `name` (which it may
    replace), before any byte is received."""
    tenant = session.get(Tenant, tenant_id)
    assert tenant is not None
    old = session.scalar(
        select(Dataset.size_bytes).where(Dataset.tenant_id == tenant_id, Dataset.name == name)
    )
    quotas.check_dataset(session, tenant, size_bytes, replaces=old or 0)


def store(
    session: Session, tenant_id: str, name: str, upload: Upload, artifact_dir: Path
) -> tuple[Dataset, Path | None]:
    """Record `upload` as the tenant's dataset `name` (replacing one of that name) and
    move its file into place. Returns the row and the replaced file, to delete after
    the transaction commits."""
    tenant = session.get(Tenant, tenant_id, with_for_update=True)
    assert tenant is not None
    old = session.scalars(
        select(Dataset).where(Dataset.tenant_id == tenant_id, Dataset.name == name)
    ).one_or_none()
    quotas.check_dataset(session, tenant, upload.size_bytes, replaces=old.size_bytes if old else 0)
    dataset_id = new_id("ds")
    final = tenant_dir(artifact_dir, tenant_id) / f"{dataset_id}.jsonl"
    replaced = artifact_dir / old.path if old else None
    if old is not None:
        _check_unused(session, tenant_id, name, "replace")
        session.delete(old)
        session.flush()
    row = Dataset(
        id=dataset_id,
        tenant_id=tenant_id,
        name=name,
        path=final.relative_to(artifact_dir).as_posix(),
        size_bytes=upload.size_bytes,
        rows=upload.rows,
        sha256=upload.sha256,
        created_at=utcnow(),
    )
    session.add(row)
    session.flush()
    upload.tmp_path.replace(final)
    return row, replaced


def get(session: Session, tenant_id: str, name: str) -> Dataset:
    row = session.scalars(
        select(Dataset).where(Dataset.tenant_id == tenant_id, Dataset.name == name)
    ).one_or_none()
    if row is None:
        raise NotFound(f"no dataset named {name!r}; list yours with GET /v1/datasets")
    return row


def delete(session: Session, tenant_id: str, name: str, artifact_dir: Path) -> Path:
    """Delete the tenant's dataset `name` unless an active job uses it; returns its file
    (to remove after commit)."""
    row = get(session, tenant_id, name)
    _check_unused(session, tenant_id, name, "delete")
    session.delete(row)
    return artifact_dir / row.path


def resolve_spec(session: Session, tenant_id: str, spec: JobSpec, artifact_dir: Path) -> JobSpec:
    """The spec a backend runs: dataset names (`path`, `eval_path`) replaced by the
    absolute paths of their files."""
    task = spec.task
    if not isinstance(task, DatasetSpec):
        return spec

    def where(name: str) -> str:
        return str((artifact_dir / get(session, tenant_id, name).path).resolve())

    paths = {"path": where(task.path)}
    if task.eval_path is not None:
        paths["eval_path"] = where(task.eval_path)
    return spec.model_copy(update={"task": task.model_copy(update=paths)})
