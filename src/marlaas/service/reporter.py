"""How a job backend writes what happened back into the database.

Each report is one short transaction run in a worker thread (`asyncio.to_thread`),
so the event loop never waits on the database. Reports obey the lifecycle
(`lifecycle.REPORTED`): a status report that does not apply (say, `running` for a job
the tenant has just cancelled) is ignored and returns False, because the tenant's
action wins; the backend learns about that action through its own `cancel`/`pause`
call. Checkpoints and metrics are facts and are always recorded, with two exceptions:
- a job's `keep_checkpoints`: recording a checkpoint drops the rows of older ones
  beyond it, then (after the commit) their folders; a crash in between leaves folders
  that nothing refers to (a restored job's backend reports them again, and they are
  dropped then; a finished job's go when the job is deleted);
- a job the tenant deleted: every report about it is ignored (a late one of a backend
  still winding the job down; only a step still counts toward its steps used), and its
  files are removed by `deletion.purge_deleted_jobs`.

When a job is done, the reporter's `on_done` hooks run in the transaction that says so,
each in a savepoint of its own: a hook that fails is logged and undone, and the job is
done regardless (the OpenAI routes' results file, `openai_ft.results`).

A job restored from its checkpoint after a crash (`restored`) continues from a
checkpoint older than the
steps it had reported: `steps_done` goes back to the checkpoint's step and the later
steps' metrics are dropped, since that work is lost and is trained again. Each re-run
step then updates the event it had already (same id), so the event stream holds one
event per step and never repeats one; a `resumed` event (its public name) marks where
it continued.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from marlaas.service.db import Database
from marlaas.service.deletion import checkpoint_folder, remove_dirs
from marlaas.service.errors import NotFound, redact_paths
from marlaas.service.events import JobNotifier
from marlaas.service.jobs import add_event
from marlaas.service.lifecycle import REPORTED, JobStatus
from marlaas.service.models import Checkpoint, Job, JobEvent, Metric, utcnow

log = logging.getLogger(__name__)


def _finite(metrics: Mapping[str, float | None]) -> dict[str, float | None]:
    """Scalars as stored: NaN and infinities become None (JSON has no NaN)."""
    return {
        str(k): float(v) if v is not None and math.isfinite(v) else None for k, v in metrics.items()
    }


def _event_key(data: Mapping[str, Any]) -> tuple[int, tuple[str, ...]]:
    """What identifies a step event: its step and its metrics' names (a step has a
    train event and, when evaluated, an eval event)."""
    return int(data["step"]), tuple(sorted(data["metrics"]))


#: Run when a job is done: (session, job, artifact directory); see the module docstring.
DoneHook = Callable[[Session, Job, Path], None]


class JobReporter:
    """The backend's handle on the database; one per app."""

    def __init__(self, db: Database, artifact_dir: Path, on_done: Sequence[DoneHook] = ()) -> None:
        self._db = db
        self.artifact_dir = artifact_dir
        self._on_done = tuple(on_done)
        self.notifier = JobNotifier()
        """Woken after every committed report, so event streams need not poll."""
        #: Per resumed job, the events of steps it trains again: (step, metric names) ->
        #: event id (used and written from the event loop only).
        self._rerun: dict[str, dict[tuple[int, tuple[str, ...]], int]] = {}

    @staticmethod
    def _job(session: Session, job_id: str, report: str) -> Job | None:
        """The job, locked; None (report ignored) when the tenant deleted it."""
        job = session.get(Job, job_id, with_for_update=True)
        if job is None:
            raise NotFound(f"no job with id {job_id!r} in the service database")
        if job.deleted_at is not None:
            log.info("job %s: ignored report %s (the job was deleted)", job_id, report)
            return None
        return job

    async def status(self, job_id: str, status: JobStatus, reason: str | None = None) -> bool:
        """Report that the job is now `running`, `done` or `failed` (with `reason`).

        Returns False (and changes nothing) when the job's current status does not
        allow it, e.g. it was cancelled meanwhile.
        """
        if status not in REPORTED:
            raise ValueError(f"a backend reports running, done or failed, not {status}")
        changed = await asyncio.to_thread(self._status, job_id, status, reason)
        self.notifier.notify(job_id)
        return changed

    def _status(self, job_id: str, status: JobStatus, reason: str | None) -> bool:
        with self._db.transaction() as session:
            job = self._job(session, job_id, str(status))
            if job is None:
                return False
            if JobStatus(job.status) not in REPORTED[status]:
                log.info("job %s: ignored report %s (job is %s)", job_id, status, job.status)
                return False
            job.status = status
            job.updated_at = utcnow()
            if reason is not None:  # the tenant reads it: no server paths
                reason = redact_paths(reason)
            if status is JobStatus.FAILED:
                job.failure_reason = reason or "failed (no reason given)"
            add_event(session, job, "status", {"status": str(status), "reason": reason})
            if status is JobStatus.DONE:
                for hook in self._on_done:
                    try:
                        with session.begin_nested():
                            hook(session, job, self.artifact_dir)
                    except Exception:
                        log.exception("job %s: a hook on its end failed", job_id)
            return True

    async def restored(self, job_id: str, step: int) -> None:
        """Report that the job continues from its checkpoint at `step` (see the module
        docstring)."""
        rerun = await asyncio.to_thread(self._restored, job_id, step)
        self._rerun[job_id] = rerun
        self.notifier.notify(job_id)

    def _restored(self, job_id: str, step: int) -> dict[tuple[int, tuple[str, ...]], int]:
        with self._db.transaction() as session:
            job = self._job(session, job_id, f"restored at {step}")
            if job is None:
                return {}
            job.steps_done = min(job.steps_done, step)
            job.updated_at = utcnow()
            session.execute(delete(Metric).where(Metric.job_id == job_id, Metric.step > step))
            rows = session.execute(
                select(JobEvent.id, JobEvent.data)
                .where(JobEvent.job_id == job_id, JobEvent.kind == "step")
                .order_by(JobEvent.id)
            ).all()
            rerun = {_event_key(data): event_id for event_id, data in rows if data["step"] > step}
            add_event(session, job, "resumed", {"step": step})
            return rerun

    async def step(self, job_id: str, step: int, metrics: Mapping[str, float | None]) -> None:
        """Report that optimizer step `step` (1-based) finished, with its scalars. A step
        reported again (trained again after a crash resumed the job from an earlier
        checkpoint) replaces its earlier values: a metric has one value per step, and
        the step's event is updated in place."""
        values = _finite(metrics)
        event_id = self._rerun.get(job_id, {}).pop(
            _event_key({"step": step, "metrics": values}), None
        )
        await asyncio.to_thread(self._step, job_id, step, values, event_id)
        self.notifier.notify(job_id)

    def _step(
        self, job_id: str, step: int, metrics: dict[str, float | None], event_id: int | None
    ) -> None:
        now = utcnow()
        with self._db.transaction() as session:
            job = self._job(session, job_id, f"step {step}")
            if job is None:  # deleted: no metrics, but the step still counts for quotas
                session.execute(
                    update(Job)
                    .where(Job.id == job_id, Job.steps_done < step)
                    .values(steps_done=step)
                )
                return
            job.steps_done = max(job.steps_done, step)
            job.updated_at = now
            session.execute(
                delete(Metric).where(
                    Metric.job_id == job_id, Metric.step == step, Metric.name.in_(list(metrics))
                )
            )
            session.add_all(
                Metric(job_id=job_id, step=step, name=name, value=value, time=now)
                for name, value in metrics.items()
            )
            data = {"step": step, "metrics": metrics}
            event = session.get(JobEvent, event_id) if event_id is not None else None
            if event is not None:  # a re-run step: its event says what it is now
                event.data, event.time = data, now
            else:
                add_event(session, job, "step", data)

    async def checkpoint(
        self, job_id: str, step: int, path: Path, metrics: Mapping[str, float | None]
    ) -> None:
        """Record a checkpoint written (atomically, already complete) at `path`, which
        must lie inside the artifact directory."""
        root = self.artifact_dir.resolve()
        try:
            relative = Path(path).resolve().relative_to(root)
        except ValueError:
            raise ValueError(
                f"checkpoint {path} lies outside the artifact directory {root}; write "
                "checkpoints under it, so the database can refer to them portably"
            ) from None
        dropped = await asyncio.to_thread(
            self._checkpoint, job_id, step, relative.as_posix(), _finite(metrics)
        )
        self.notifier.notify(job_id)
        if dropped:  # committed: now their folders (a crash before this leaves them
            # unreferenced; a resumed job's backend reports them again, see _checkpoint)
            try:
                await asyncio.to_thread(self._remove_checkpoints, job_id, dropped)
            except OSError:
                log.exception("job %s: could not remove dropped checkpoints", job_id)

    def _checkpoint(
        self, job_id: str, step: int, path: str, metrics: dict[str, float | None]
    ) -> list[str]:
        """Record the checkpoint, and apply the job's `keep_checkpoints`: the rows of
        older checkpoints beyond it go in the same transaction; returns their paths,
        whose folders the caller removes after the commit. A checkpoint that is itself
        beyond it (older than the newest kept ones: a folder that a crash left behind,
        reported again at recovery) is not recorded, and its path is returned."""
        with self._db.transaction() as session:
            job = self._job(session, job_id, f"checkpoint {step}")
            if job is None:
                return []
            keep = job.spec.get("keep_checkpoints")
            mine = select(Checkpoint).where(Checkpoint.job_id == job_id)
            if keep is not None:
                newer = session.scalar(
                    select(func.count()).select_from(mine.where(Checkpoint.step > step).subquery())
                )
                if (newer or 0) >= keep:
                    log.info("job %s: checkpoint %d is beyond keep_checkpoints", job_id, step)
                    return [path]
            session.add(
                Checkpoint(
                    job_id=job_id, step=step, path=path, metrics=metrics, created_at=utcnow()
                )
            )
            add_event(session, job, "checkpoint", {"step": step, "metrics": metrics})
            if keep is None:
                return []
            session.flush()
            dropped = session.scalars(mine.order_by(Checkpoint.step.desc()).offset(keep)).all()
            for ckpt in dropped:
                session.delete(ckpt)
            return [ckpt.path for ckpt in dropped]

    def _remove_checkpoints(self, job_id: str, paths: list[str]) -> None:
        folders = (checkpoint_folder(self.artifact_dir, job_id, p) for p in paths)
        remove_dirs(f for f in folders if f is not None)
