"""Removing files: a deleted job's (checkpoints, final adapter, everything under the
job's directory; an uploaded dataset the job trained on is the tenant's own and stays),
and single checkpoints that a job's `keep_checkpoints` drops (see `reporter`).

Crash safety comes from the order, never from a transaction spanning the file system:
1. `jobs.delete_job` hides the job (`deleted_at`) and commits: from then on nothing
   serves, lists or reports it, and its files are garbage;
2. `purge_deleted_jobs` removes the files of every hidden job, then its checkpoint
   rows (which told it where the files were).
A crash before 1 commits leaves a visible, intact job; a crash anywhere after leaves a
hidden job with some files, which the next purge removes: one runs at every start of
the service (`app.open_context`) and after every delete. Each step is idempotent.

A job's directories: `<artifact_dir>/pipeline/tenants/<job id>/` (where
`PipelineBackend` writes), and, for each checkpoint row, the part of its path up to the
path component that is the job's id (the job's folder in any backend's layout), or the
checkpoint's own directory when its path names no such folder. Only paths strictly
inside the artifact directory are ever removed.
"""

from __future__ import annotations

import logging
import shutil
from collections import defaultdict
from collections.abc import Collection, Iterable
from pathlib import Path

from sqlalchemy import delete, select

from marlaas.service.archive import ADAPTER_SUBDIR
from marlaas.service.db import Database
from marlaas.service.models import Checkpoint, Job

log = logging.getLogger(__name__)

#: Where `PipelineBackend` keeps each job's files (relative to the artifact directory).
PIPELINE_TENANTS = Path("pipeline") / "tenants"


def job_dirs(artifact_dir: Path, job_id: str, checkpoint_paths: Iterable[str]) -> list[Path]:
    """The directories holding the job's files (see the module docstring), each inside
    `artifact_dir`, none inside another; some may not exist."""
    root = artifact_dir.resolve()
    found = {root / PIPELINE_TENANTS / job_id}
    for stored in checkpoint_paths:
        parts = Path(stored).parts
        if job_id in parts:
            found.add(root.joinpath(*parts[: parts.index(job_id) + 1]))
        else:
            found.add(root / stored)
    inside: list[Path] = []
    for path in sorted(found):
        resolved = path.resolve()
        if resolved == root or not resolved.is_relative_to(root):
            log.warning("not removing %s: it is not inside the artifact directory", path)
            continue
        if not any(resolved.is_relative_to(kept) for kept in inside):
            inside.append(resolved)
    return inside


def checkpoint_folder(artifact_dir: Path, job_id: str, stored: str) -> Path | None:
    """The folder of job `job_id`'s checkpoint whose row holds `stored`: the path
    itself, or its parent when it is the checkpoint's PEFT `adapter/` subfolder (the
    pipeline's layout, whose parent holds the optimizer state too); None when that is
    not strictly inside `artifact_dir`, or is the job's whole folder."""
    root = artifact_dir.resolve()
    path = (root / stored).resolve()
    if path.name == ADAPTER_SUBDIR:
        path = path.parent
    if path == root or not path.is_relative_to(root) or path.name == job_id:
        log.warning("not removing %s: it is not a checkpoint's own folder", stored)
        return None
    return path


def _rmtree(path: Path) -> None:
    """`shutil.rmtree`, except that parts removed meanwhile (by a concurrent purge) are
    fine; other errors (permissions) raise."""
    for _ in range(5):
        try:
            shutil.rmtree(path)
            return
        except FileNotFoundError:
            if not path.exists():
                return
    shutil.rmtree(path)


def remove_dirs(paths: Iterable[Path]) -> int:
    """Remove each directory (or file) that exists; returns how many existed."""
    removed = 0
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            _rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink(missing_ok=True)
        else:
            continue
        removed += 1
    return removed


def purge_deleted_jobs(
    db: Database, artifact_dir: Path, job_ids: Collection[str] | None = None
) -> list[str]:
    """Remove the leftover files and checkpoint rows of deleted jobs (all of them, or
    those of `job_ids`); returns the ids of the jobs that had some. Safe to run at any
    time, concurrently with itself: it only touches jobs already hidden."""
    with db.transaction() as session:
        query = select(Job.id).where(Job.deleted_at.is_not(None))
        if job_ids is not None:
            query = query.where(Job.id.in_(list(job_ids)))
        deleted = list(session.scalars(query))
        paths: dict[str, list[str]] = defaultdict(list)
        for chunk in _chunks(deleted, 500):
            rows = session.execute(
                select(Checkpoint.job_id, Checkpoint.path).where(Checkpoint.job_id.in_(chunk))
            )
            for job_id, path in rows:
                paths[job_id].append(path)
    purged: list[str] = []
    for job_id in deleted:
        if remove_dirs(job_dirs(artifact_dir, job_id, paths.get(job_id, ()))) or job_id in paths:
            purged.append(job_id)
    with_rows = [j for j in deleted if j in paths]
    if with_rows:
        with db.transaction() as session:
            for chunk in _chunks(with_rows, 500):
                session.execute(delete(Checkpoint).where(Checkpoint.job_id.in_(chunk)))
    if purged:
        log.info("removed the files of %d deleted job(s)", len(purged))
    return purged


def _chunks(items: list[str], size: int) -> Iterable[list[str]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]
