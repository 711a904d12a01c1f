"""`ft:` model names of OpenAI fine-tuning jobs.

A job's trained model is `ft:BASE:TENANT:SUFFIX:JOB` (`SUFFIX` empty when the request
gave none, as OpenAI spells it: `ft:base:acme::job_3f9a...`), and its checkpoint at
optimizer step N is that name plus `:ckpt-step-N`. `job_model_name` resolves such a name
for a tenant to the marlaas model name of the same adapter (`JOB` or `JOB:ckpt-N`), or
None: a name that is malformed, belongs to another tenant, or does not match the job's
own name exactly is not found, like any unknown model.
"""

from __future__ import annotations

import re

from sqlalchemy import select
from sqlalchemy.orm import Session

from marlaas.service.db import Database
from marlaas.service.models import FineTuningJob, Job

FT_PREFIX = "ft:"
_CKPT = re.compile(r"^(?P<model>ft:.+):ckpt-step-(?P<step>\d{1,9})$")


def fine_tuned_model(base: str, tenant: str, suffix: str | None, job_id: str) -> str:
    return f"{FT_PREFIX}{base}:{tenant}:{suffix or ''}:{job_id}"


def checkpoint_model(name: str, step: int) -> str:
    return f"{name}:ckpt-step-{step}"


def job_model_name(db: Database, tenant_id: str, name: str) -> str | None:
    """The marlaas name (`JOB` or `JOB:ckpt-N`) of the tenant's `ft:` model `name`."""
    found = _CKPT.match(name)
    model, step = (found["model"], int(found["step"])) if found else (name, None)
    job_id = model.rsplit(":", 1)[-1]
    with db.transaction() as session:
        exists = session.scalar(
            select(FineTuningJob.job_id)
            .join(Job, Job.id == FineTuningJob.job_id)
            .where(
                FineTuningJob.job_id == job_id,
                FineTuningJob.fine_tuned_model == model,
                Job.tenant_id == tenant_id,
                Job.deleted_at.is_(None),
            )
        )
    if exists is None:
        return None
    return job_id if step is None else f"{job_id}:ckpt-{step}"


def aliases(session: Session, tenant_id: str) -> dict[str, str]:
    """The `ft:` name of each of the tenant's OpenAI fine-tuning jobs, by job id."""
    rows = session.execute(
        select(FineTuningJob.job_id, FineTuningJob.fine_tuned_model)
        .join(Job, Job.id == FineTuningJob.job_id)
        .where(Job.tenant_id == tenant_id, Job.deleted_at.is_(None))
    ).all()
    return {job_id: name for job_id, name in rows}


def alias_of(name: str, job_id: str, ft_name: str) -> str:
    """The `ft:` name of the marlaas model `name` (`JOB` or `JOB:ckpt-N`) of a job."""
    step = name[len(job_id) + len(":ckpt-") :] if name != job_id else None
    return ft_name if step is None else checkpoint_model(ft_name, int(step))
