"""The OpenAI objects of a fine-tuning job, made from marlaas's rows: the job
(`fine_tuning.job`), its events (`fine_tuning.job.event`) and checkpoints
(`fine_tuning.job.checkpoint`), with every field the SDK's models parse.

Status words: marlaas `queued`, `running`, `paused`, `cancelled`, `failed` are OpenAI's
own; `done` is `succeeded`. Files are checked when they are uploaded, so a job is never
`validating_files`: it is `queued` as soon as it is created. `fine_tuned_model` is set
once the job succeeded (the adapter of a running job answers to the same name already).
`result_files` names the results CSV of a succeeded job (`results`), else is empty.

A supervised job's figures carry OpenAI's names in its metrics events and checkpoints
(`SFT_NAMES`): `train_loss` (the step's mean token NLL), `train_mean_token_accuracy`,
and from the evals, which score the whole held-out set, `valid_loss`,
`valid_mean_token_accuracy` and the same as `full_valid_loss` and
`full_valid_mean_token_accuracy`; its other figures keep marlaas's names.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from marlaas.service.lifecycle import TERMINAL, JobStatus
from marlaas.service.models import Checkpoint, FineTuningJob, Job, JobEvent
from marlaas.service.openai_ft.names import checkpoint_model

STATUS = {
    JobStatus.QUEUED: "queued",
    JobStatus.RUNNING: "running",
    JobStatus.PAUSED: "paused",
    JobStatus.DONE: "succeeded",
    JobStatus.FAILED: "failed",
    JobStatus.CANCELLED: "cancelled",
}
#: marlaas's names of a supervised job's figures -> OpenAI's (see the module docstring).
SFT_NAMES = {
    "loss": ("train_loss",),
    "token_accuracy": ("train_mean_token_accuracy",),
    "eval_loss": ("valid_loss", "full_valid_loss"),
    "eval_accuracy": ("valid_mean_token_accuracy", "full_valid_mean_token_accuracy"),
}
_EVAL_NAMES = {"eval_accuracy", "eval_loss"}
EVENT_PREFIX = "ftevent-"
CHECKPOINT_PREFIX = "ftckpt-"


def _ts(when: datetime) -> int:
    return int(when.timestamp())


def job_object(
    job: Job,
    ft: FineTuningJob,
    organization: str,
    trained_tokens: int | None,
    now: datetime,
    result_files: list[str] | None = None,
) -> dict[str, Any]:
    status = JobStatus(job.status)
    done = status in TERMINAL
    hp = ft.method[ft.method["type"]]["hyperparameters"]
    estimated = None
    if status is JobStatus.RUNNING and 0 < job.steps_done < job.steps:
        per_step = (now - job.created_at).total_seconds() / job.steps_done
        estimated = _ts(now) + int(per_step * (job.steps - job.steps_done))
    error = None
    if status is JobStatus.FAILED:
        error = {"code": "job_failed", "message": job.failure_reason or "failed", "param": None}
    return {
        "id": job.id,
        "object": "fine_tuning.job",
        "created_at": _ts(job.created_at),
        "error": error,
        "fine_tuned_model": ft.fine_tuned_model if status is JobStatus.DONE else None,
        "finished_at": _ts(job.updated_at) if done else None,
        "hyperparameters": {
            k: hp[k] for k in ("batch_size", "learning_rate_multiplier", "n_epochs")
        },
        "model": ft.model,
        "organization_id": organization,
        "result_files": result_files or [],
        "seed": ft.seed,
        "status": STATUS[status],
        "trained_tokens": trained_tokens if done else None,
        "training_file": ft.training_file,
        "validation_file": ft.validation_file,
        "estimated_finish": estimated,
        "integrations": None,
        "metadata": ft.tags,
        "method": ft.method,
        "user_provided_suffix": ft.suffix,
    }


def _status_message(data: dict[str, Any], first: bool) -> tuple[str, str]:
    """(level, message) of a status event."""
    status, action = data.get("status"), data.get("action")
    if status == JobStatus.QUEUED:
        if first:
            return "info", "Created fine-tuning job; its files were validated"
        return "info", "Fine-tuning job resumed" if action == "resume" else "Fine-tuning job queued"
    if status == JobStatus.FAILED:
        return "error", f"Fine-tuning job failed: {data.get('reason') or 'no reason given'}"
    words = {
        JobStatus.RUNNING: "Fine-tuning job started",
        JobStatus.PAUSED: "Fine-tuning job paused",
        JobStatus.CANCELLED: "Fine-tuning job cancelled",
        JobStatus.DONE: "The job has successfully completed",
    }
    return "info", words.get(JobStatus(str(status)), f"Fine-tuning job is {status}")


def _supervised(ft: FineTuningJob) -> bool:
    return bool(ft.method.get("type") == "supervised")


def openai_metrics(metrics: dict[str, Any], ft: FineTuningJob) -> dict[str, Any]:
    """A job's figures under the names its method's events use (`SFT_NAMES`)."""
    if not _supervised(ft):
        return dict(metrics)
    out: dict[str, Any] = {}
    for name, value in metrics.items():
        for renamed in SFT_NAMES.get(name, (name,)):
            out[renamed] = value
    return out


def _number(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def event_object(row: JobEvent, first_id: int, steps: int, ft: FineTuningJob) -> dict[str, Any]:
    data = dict(row.data)
    kind = "message"
    if row.kind == "status":
        level, message = _status_message(data, row.id == first_id)
    elif row.kind == "step":
        kind, level = "metrics", "info"
        raw = dict(data.get("metrics") or {})
        metrics = openai_metrics(raw, ft)
        shown = ", ".join(f"{k}={_number(v)}" for k, v in sorted(metrics.items()))
        # An eval is reported at the adapter version (= step) it evaluated.
        what = "Eval at step" if raw and set(raw) <= _EVAL_NAMES else "Step"
        message = f"{what} {data.get('step')}/{steps}: {shown}"
        data = {"step": data.get("step"), "total_steps": steps, **metrics}
    elif row.kind == "checkpoint":
        level = "info"
        step = int(data.get("step", 0))
        message = f"Checkpoint created at step {step}"
        data = {**data, "fine_tuned_model_checkpoint": checkpoint_model(ft.fine_tuned_model, step)}
    else:
        level, message = "info", row.kind
    return {
        "id": f"{EVENT_PREFIX}{row.id}",
        "object": "fine_tuning.job.event",
        "created_at": _ts(row.time),
        "level": level,
        "message": message,
        "data": data,
        "type": kind,
    }


def checkpoint_object(row: Checkpoint, ft: FineTuningJob) -> dict[str, Any]:
    metrics = openai_metrics(dict(row.metrics or {}), ft)
    if not _supervised(ft):  # RFT: the step's loss is the train loss
        metrics["train_loss"] = metrics.pop("loss", None)
    return {
        "id": f"{CHECKPOINT_PREFIX}{row.id}",
        "object": "fine_tuning.job.checkpoint",
        "created_at": _ts(row.created_at),
        "fine_tuned_model_checkpoint": checkpoint_model(ft.fine_tuned_model, row.step),
        "fine_tuning_job_id": row.job_id,
        "step_number": row.step,
        "metrics": {
            "step": float(row.step),
            "train_loss": None,
            "train_mean_token_accuracy": None,
            "valid_loss": None,
            "valid_mean_token_accuracy": None,
            "full_valid_loss": None,
            "full_valid_mean_token_accuracy": None,
            **metrics,
        },
    }


def cursor(value: str | None, prefix: str) -> int | None:
    """The row id of an `after` cursor (`ftevent-12` -> 12); None for none; -1 for one
    that is not of this list (which then yields nothing)."""
    if value is None:
        return None
    if value.startswith(prefix) and value[len(prefix) :].isdigit():
        return int(value[len(prefix) :])
    return -1
