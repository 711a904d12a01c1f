"""The results file of an OpenAI fine-tuning job (`FineTuningJob.result_files`): a CSV
of the job's recorded step metrics, written when the job succeeds and stored as one of
its tenant's files (purpose `fine-tune-results`), so `GET /v1/files/{id}/content`
downloads it and `GET /v1/files` lists it.

Its id is `file-<job id>`: one results file per job, found without a column of its own,
and written once (a second success report finds it). The CSV has a `step` column, then
one column per metric the job recorded (marlaas's names, as the job's metrics events
carry them: `reward_mean`, `loss`, `eval_accuracy`, ...), one row per step in order,
empty where a step lacks a metric (an eval's metrics are only at its steps). A supervised
job's columns carry OpenAI's names (`train_loss`, `valid_loss`, ...: `wire.SFT_NAMES`). Its bytes
count toward the tenant's `max_dataset_bytes`, like an upload's; a tenant over it gets
no results file (logged), and the job succeeds regardless (`JobReporter`'s hooks).
"""

from __future__ import annotations

import csv
import hashlib
import io
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from marlaas.service import datasets as store
from marlaas.service.models import File, FineTuningJob, Job, Metric, new_id, utcnow
from marlaas.service.openai_ft.files import RESULTS_PURPOSE
from marlaas.service.openai_ft.wire import openai_metrics

FILENAME = "step_metrics.csv"


def results_file_id(job_id: str) -> str:
    return f"file-{job_id}"


def result_files(session: Session, job: Job) -> list[str]:
    """The ids of the job's results files its tenant still has ([] or one)."""
    row = session.get(File, results_file_id(job.id))
    return [row.id] if row is not None and row.tenant_id == job.tenant_id else []


def results_csv(session: Session, job_id: str, ft: FineTuningJob) -> tuple[bytes, int]:
    """The job's step metrics as CSV bytes, and its number of data rows."""
    by_step: dict[int, dict[str, float | None]] = {}
    names: set[str] = set()
    for step, name, value in session.execute(
        select(Metric.step, Metric.name, Metric.value).where(Metric.job_id == job_id)
    ):
        renamed = openai_metrics({name: value}, ft)
        by_step.setdefault(step, {}).update(renamed)
        names.update(renamed)
    columns = sorted(names)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["step", *columns])
    for step in sorted(by_step):
        values = by_step[step]
        writer.writerow(
            [step, *("" if values.get(c) is None else repr(values[c]) for c in columns)]
        )
    return out.getvalue().encode(), len(by_step)


def write_results(session: Session, job: Job, artifact_dir: Path) -> None:
    """Store the results file of `job` if it is an OpenAI fine-tuning job without one
    (a `JobReporter` hook, run in the transaction that marks the job done)."""
    ft = session.get(FineTuningJob, job.id)
    if ft is None or result_files(session, job):
        return
    data, rows = results_csv(session, job.id, ft)
    file_id = results_file_id(job.id)
    tmp = store.tenant_dir(artifact_dir, job.tenant_id) / f".results-{new_id('tmp')}"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_bytes(data)
    try:
        sha = hashlib.sha256(data).hexdigest()
        upload = store.Upload(tmp, len(data), rows, sha)
        store.store(session, job.tenant_id, file_id, upload, artifact_dir)
        session.add(
            File(
                id=file_id,
                tenant_id=job.tenant_id,
                filename=FILENAME,
                purpose=RESULTS_PURPOSE,
                size_bytes=len(data),
                rows=rows,
                status="processed",
                status_details=None,
                created_at=utcnow(),
                expires_at=None,
            )
        )
        session.flush()
    finally:
        tmp.unlink(missing_ok=True)
