"""Per-tenant quotas: what a tenant uses now, and the checks before it asks for more.

Usage is computed from the rows, never kept as a counter that could drift:
- active jobs: queued, running or paused, and the tenant's Tinker training runs on
  the device (`tinker_runs`, status active);
- steps: the steps asked by active and done jobs, plus the steps that failed and
  cancelled jobs actually ran (the unused rest is given back), plus the optimizer
  steps of its Tinker runs; a deleted job's row stays (hidden) for this, so deleting
  a job gives no steps back;
- dataset bytes: the sizes of the tenant's uploaded datasets.
Callers check inside the transaction that then inserts, with the tenant's row locked
(see `db`), so concurrent requests cannot overshoot a limit together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from marlaas.service.errors import QuotaExceeded
from marlaas.service.lifecycle import ACTIVE, JobStatus
from marlaas.service.models import Dataset, Job, Tenant, TinkerRun

if TYPE_CHECKING:
    from marlaas.service.admission import JobCost


@dataclass(frozen=True)
class Usage:
    active_jobs: int
    total_steps: int
    dataset_bytes: int


def usage(session: Session, tenant_id: str) -> Usage:
    charged_steps = case(
        (Job.status.in_([JobStatus.FAILED, JobStatus.CANCELLED]), Job.steps_done),
        else_=Job.steps,
    )
    active, steps = session.execute(
        select(
            func.count(Job.id).filter(Job.status.in_(list(ACTIVE))),
            func.coalesce(func.sum(charged_steps), 0),
        ).where(Job.tenant_id == tenant_id)
    ).one()
    data = session.scalar(
        select(func.coalesce(func.sum(Dataset.size_bytes), 0)).where(Dataset.tenant_id == tenant_id)
    )
    runs, run_steps = session.execute(
        select(
            func.count(TinkerRun.id).filter(TinkerRun.status == "active"),
            func.coalesce(func.sum(TinkerRun.steps), 0),
        ).where(TinkerRun.tenant_id == tenant_id)
    ).one()
    return Usage(
        active_jobs=int(active) + int(runs),
        total_steps=int(steps) + int(run_steps),
        dataset_bytes=int(data or 0),
    )


_ASK_ADMIN = "or ask the admin to raise it"


def check_new_job(session: Session, tenant: Tenant, steps: int) -> None:
    """Raise `QuotaExceeded` if `tenant` may not start one more job of `steps` steps."""
    used = usage(session, tenant.id)
    if used.active_jobs + 1 > tenant.max_concurrent_jobs:
        raise QuotaExceeded(
            f"quota max_concurrent_jobs exceeded: tenant {tenant.name!r} already has "
            f"{used.active_jobs} active jobs (queued, running or paused) and the limit is "
            f"{tenant.max_concurrent_jobs}; cancel one or wait for one to finish, {_ASK_ADMIN}"
        )
    if used.total_steps + steps > tenant.max_total_steps:
        left = max(tenant.max_total_steps - used.total_steps, 0)
        raise QuotaExceeded(
            f"quota max_total_steps exceeded: this job asks for {steps} steps, tenant "
            f"{tenant.name!r} has used {used.total_steps} of its limit of "
            f"{tenant.max_total_steps} ({left} left); ask for fewer steps, {_ASK_ADMIN}"
        )


def check_job_cost(tenant: Tenant, cost: JobCost) -> None:
    """Raise `QuotaExceeded` if one step or one eval of a job of this cost would ask more
    than `tenant`'s quotas allow; the message names the quota, the field and the limit."""
    asks = (
        (
            "max_samples_per_step",
            cost.samples_per_step,
            "samples per step (algorithm.group_size x algorithm.prompts_per_step)",
        ),
        ("max_eval_episodes", cost.eval_episodes, "eval episodes (eval_episodes)"),
        (
            "max_tokens_per_step",
            cost.tokens_per_step,
            f"tokens per step ({cost.samples_per_step} samples x up to "
            f"{cost.tokens_per_sequence} tokens each: the longest prompt, "
            f"{cost.longest_prompt} tokens, and {cost.max_turns} turn(s) of "
            f"sampling.max_new_tokens {cost.max_new_tokens})",
        ),
    )
    for quota, asked, what in asks:
        limit: int = getattr(tenant, quota)
        if asked > limit:
            raise QuotaExceeded(
                f"quota {quota} exceeded: this job asks for {asked} {what}, and tenant "
                f"{tenant.name!r} may ask at most {limit}; make the job smaller, {_ASK_ADMIN}"
            )


def check_dataset(session: Session, tenant: Tenant, size_bytes: int, replaces: int = 0) -> None:
    """Raise `QuotaExceeded` if `tenant` may not store `size_bytes` more dataset bytes
    (`replaces`: the size of the dataset this one overwrites, which is given back)."""
    used = usage(session, tenant.id).dataset_bytes - replaces
    if used + size_bytes > tenant.max_dataset_bytes:
        raise QuotaExceeded(
            f"quota max_dataset_bytes exceeded: this dataset is {size_bytes} bytes, tenant "
            f"{tenant.name!r} already stores {used} bytes and the limit is "
            f"{tenant.max_dataset_bytes}; delete a dataset, {_ASK_ADMIN}"
        )
