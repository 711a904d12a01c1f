"""What the Tinker-compatible API keeps across restarts, in the service's database:
training runs (`tinker_runs`) and their saved weights (`tinker_checkpoints`), whose
files lie under `<artifact dir>/tinker/<tenant id>/<run>/<weights|sampler_weights>/<name>`.

Invariants:
- Every query carries the caller's tenant id, so another tenant's run or path is
  "not found" exactly like one that never existed.
- A checkpoint row is written after its files are complete, and removed before its
  files are: a row always points at whole files.
- Quotas: a run on the device counts as one of the tenant's active jobs, each
  optimizer step as one of its steps (`quotas.usage`); `reserve_step` checks and
  counts a step in one transaction, so concurrent steps cannot overshoot the limit.
- Blocking (database and files): call from a worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from marlaas.config.specs import LoRASpec
from marlaas.service import quotas
from marlaas.service.db import Database
from marlaas.service.errors import Conflict, QuotaExceeded
from marlaas.service.models import Tenant, TinkerCheckpoint, TinkerRun, utcnow
from marlaas.service.tinker import state_io
from marlaas.service.tinker.errors import UserError, not_found
from marlaas.service.tinker.paths import CheckpointKind, TinkerPath

ACTIVE = "active"
CLOSED = "closed"
TINKER_DIR = "tinker"
_SEGMENT = {"training": "weights", "sampler": "sampler_weights"}
#: TTLs Tinker accepts: one hour to ten years.
_TTL = (3600, 10 * 365 * 24 * 3600)


@dataclass(frozen=True)
class RunRecord:
    id: str
    tenant_id: str
    tenant_name: str
    session_id: str
    base_model: str
    lora: LoRASpec
    status: str
    steps: int
    user_metadata: dict[str, Any] | None
    created_at: datetime
    last_request_at: datetime


@dataclass(frozen=True)
class CheckpointRecord:
    path: TinkerPath
    directory: Path
    size_bytes: int
    version: int
    user_metadata: dict[str, str] | None
    created_at: datetime
    expires_at: datetime | None


class TinkerStore:
    def __init__(self, db: Database, artifact_dir: Path) -> None:
        self.db = db
        self.artifact_dir = artifact_dir

    # -- runs -------------------------------------------------------------------------

    def create_run(
        self,
        tenant_id: str,
        run_id: str,
        session_id: str,
        base_model: str,
        lora: LoRASpec,
        user_metadata: dict[str, Any] | None,
    ) -> RunRecord:
        """A new active run (`QuotaExceeded` beyond the tenant's active jobs)."""
        with self.db.transaction() as session:
            tenant = self._tenant(session, tenant_id)
            if session.get(TinkerRun, run_id) is not None:
                raise Conflict(f"training run {run_id!r} exists already")
            quotas.check_new_job(session, tenant, 0)
            now = utcnow()
            row = TinkerRun(
                id=run_id,
                tenant_id=tenant_id,
                session_id=session_id,
                base_model=base_model,
                lora=lora.model_dump(mode="json"),
                status=ACTIVE,
                steps=0,
                user_metadata=user_metadata,
                created_at=now,
                last_request_at=now,
            )
            session.add(row)
            session.flush()
            return _run(row, tenant.name)

    def run(self, tenant_id: str, run_id: str) -> RunRecord:
        with self.db.transaction() as session:
            row = session.get(TinkerRun, run_id)
            if row is None or row.tenant_id != tenant_id:
                raise not_found("training run", run_id)
            return _run(row, self._tenant(session, tenant_id).name)

    def runs(self, tenant_id: str, limit: int, offset: int) -> tuple[list[RunRecord], int]:
        """The tenant's runs, newest first, and how many it has."""
        with self.db.transaction() as session:
            name = self._tenant(session, tenant_id).name
            total = session.scalar(
                select(func.count(TinkerRun.id)).where(TinkerRun.tenant_id == tenant_id)
            )
            rows = session.scalars(
                select(TinkerRun)
                .where(TinkerRun.tenant_id == tenant_id)
                .order_by(TinkerRun.created_at.desc(), TinkerRun.id)
                .limit(limit)
                .offset(offset)
            )
            return [_run(r, name) for r in rows], int(total or 0)

    def close_run(self, run_id: str) -> None:
        with self.db.transaction() as session:
            session.execute(update(TinkerRun).where(TinkerRun.id == run_id).values(status=CLOSED))

    def close_all(self) -> int:
        """Mark every run closed (at start: nothing is on a new device yet)."""
        with self.db.transaction() as session:
            result = session.execute(
                update(TinkerRun).where(TinkerRun.status == ACTIVE).values(status=CLOSED)
            )
            return int(getattr(result, "rowcount", 0) or 0)

    def reserve_step(self, tenant_id: str, run_id: str) -> None:
        """Count one optimizer step of the run, or raise `QuotaExceeded`."""
        with self.db.transaction() as session:
            tenant = self._tenant(session, tenant_id)
            used = quotas.usage(session, tenant_id).total_steps
            if used + 1 > tenant.max_total_steps:
                raise QuotaExceeded(
                    f"quota max_total_steps exceeded: tenant {tenant.name!r} has used {used} "
                    f"of its {tenant.max_total_steps} optimizer steps (jobs and Tinker runs "
                    "together); ask the admin to raise it"
                )
            session.execute(
                update(TinkerRun)
                .where(TinkerRun.id == run_id)
                .values(steps=TinkerRun.steps + 1, last_request_at=utcnow())
            )

    def release_step(self, run_id: str) -> None:
        """Give back a step whose update failed."""
        with self.db.transaction() as session:
            session.execute(
                update(TinkerRun)
                .where(TinkerRun.id == run_id, TinkerRun.steps > 0)
                .values(steps=TinkerRun.steps - 1)
            )

    # -- checkpoints ------------------------------------------------------------------

    def directory(self, tenant_id: str, path: TinkerPath) -> Path:
        run = path.run_id.replace(":", "_")
        return self.artifact_dir / TINKER_DIR / tenant_id / run / _SEGMENT[path.kind] / path.name

    def check_free(self, tenant_id: str, path: TinkerPath, overwrite: bool) -> None:
        """`UserError` when `path` is taken and `overwrite` is not set."""
        if not overwrite and self._find(tenant_id, path) is not None:
            raise UserError(f"{path} exists; pass overwrite=True or pick another name")

    def add_checkpoint(
        self,
        tenant_id: str,
        path: TinkerPath,
        size_bytes: int,
        version: int,
        user_metadata: dict[str, str] | None,
        ttl_seconds: int | None,
    ) -> CheckpointRecord:
        """Record weights whose files are complete (replacing a row of the same path)."""
        if ttl_seconds is not None and not _TTL[0] <= ttl_seconds <= _TTL[1]:
            raise UserError(
                f"ttl_seconds must be from {_TTL[0]} (an hour) to {_TTL[1]} (ten years)"
            )
        directory = self.directory(tenant_id, path)
        now = utcnow()
        with self.db.transaction() as session:
            run = session.get(TinkerRun, path.run_id)
            if run is None or run.tenant_id != tenant_id:
                raise not_found("training run", path.run_id)
            session.execute(delete(TinkerCheckpoint).where(*_where(path)))
            row = TinkerCheckpoint(
                run_id=path.run_id,
                kind=path.kind,
                name=path.name,
                path=str(directory.relative_to(self.artifact_dir)),
                size_bytes=size_bytes,
                version=version,
                user_metadata=user_metadata,
                created_at=now,
                expires_at=None if ttl_seconds is None else now + timedelta(seconds=ttl_seconds),
            )
            session.add(row)
            run.last_request_at = now
            session.flush()
            return self._record(row)

    def checkpoint(self, tenant_id: str, path: TinkerPath) -> CheckpointRecord:
        found = self._find(tenant_id, path)
        if found is None or not found.directory.is_dir():
            raise not_found("checkpoint", str(path))
        return found

    def checkpoints(
        self, tenant_id: str, run_id: str | None = None, kind: CheckpointKind | None = None
    ) -> list[CheckpointRecord]:
        """The tenant's live checkpoints (of one run, of one kind), oldest first."""
        query = (
            select(TinkerCheckpoint)
            .join(TinkerRun, TinkerRun.id == TinkerCheckpoint.run_id)
            .where(TinkerRun.tenant_id == tenant_id, *_live())
            .order_by(TinkerCheckpoint.created_at, TinkerCheckpoint.id)
        )
        if run_id is not None:
            query = query.where(TinkerCheckpoint.run_id == run_id)
        if kind is not None:
            query = query.where(TinkerCheckpoint.kind == kind)
        with self.db.transaction() as session:
            return [self._record(r) for r in session.scalars(query)]

    def delete_checkpoint(self, tenant_id: str, path: TinkerPath) -> None:
        found = self.checkpoint(tenant_id, path)
        with self.db.transaction() as session:
            session.execute(delete(TinkerCheckpoint).where(*_where(path)))
        state_io.remove(found.directory)

    def purge_expired(self) -> int:
        """Remove expired checkpoints, rows first; returns how many."""
        with self.db.transaction() as session:
            rows = session.scalars(
                select(TinkerCheckpoint).where(
                    TinkerCheckpoint.expires_at.is_not(None),
                    TinkerCheckpoint.expires_at <= utcnow(),
                )
            ).all()
            dirs = [self.artifact_dir / r.path for r in rows]
            for r in rows:
                session.delete(r)
        for d in dirs:
            state_io.remove(d)
        return len(dirs)

    # -- helpers ----------------------------------------------------------------------

    def _find(self, tenant_id: str, path: TinkerPath) -> CheckpointRecord | None:
        with self.db.transaction() as session:
            row = session.scalars(
                select(TinkerCheckpoint)
                .join(TinkerRun, TinkerRun.id == TinkerCheckpoint.run_id)
                .where(TinkerRun.tenant_id == tenant_id, *_where(path), *_live())
            ).one_or_none()
            return None if row is None else self._record(row)

    def _record(self, row: TinkerCheckpoint) -> CheckpointRecord:
        kind: CheckpointKind = "training" if row.kind == "training" else "sampler"
        return CheckpointRecord(
            path=TinkerPath(row.run_id, kind, row.name),
            directory=self.artifact_dir / row.path,
            size_bytes=row.size_bytes,
            version=row.version,
            user_metadata=row.user_metadata,
            created_at=row.created_at,
            expires_at=row.expires_at,
        )

    @staticmethod
    def _tenant(session: Session, tenant_id: str) -> Tenant:
        tenant = session.get(Tenant, tenant_id)
        if tenant is None:
            raise not_found("tenant", tenant_id)
        return tenant


def _where(path: TinkerPath) -> tuple[Any, ...]:
    return (
        TinkerCheckpoint.run_id == path.run_id,
        TinkerCheckpoint.kind == path.kind,
        TinkerCheckpoint.name == path.name,
    )


def _live() -> tuple[Any, ...]:
    return ((TinkerCheckpoint.expires_at.is_(None)) | (TinkerCheckpoint.expires_at > utcnow()),)


def _run(row: TinkerRun, tenant_name: str) -> RunRecord:
    return RunRecord(
        id=row.id,
        tenant_id=row.tenant_id,
        tenant_name=tenant_name,
        session_id=row.session_id,
        base_model=row.base_model,
        lora=LoRASpec.model_validate(row.lora),
        status=row.status,
        steps=row.steps,
        user_metadata=row.user_metadata,
        created_at=row.created_at,
        last_request_at=row.last_request_at,
    )
