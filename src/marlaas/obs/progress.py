"""The typed progress records the pipeline emits, one class per thing that happened.

The orchestrator (and the synchronous baseline) report a tenant's progress only as
these records, through `Recorder.progress`; everything that follows a run subscribes
to them: `RunRecorder` (JSONL files, summary, queries), the live view, the plots, the
service's job rows (`service.pipeline_backend`) and the sync estimate
(`pipeline.estimate`). A subscriber tells records apart by their type and reads their
fields; nobody matches metric or event names as strings. Metric names appear here
only (`StepMetrics.as_dict`, `EvalDone.as_dict`, `CheckpointWritten.metrics`): the names
under which figures are written to files and to the service's database (public names:
the job API serves them).

Each record also names itself for logs (`event`: the event name in `events.jsonl`, the
trace and the summary) and gives its log fields (`log_fields`); logs are for people and
tools, never read back by the system.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

from marlaas.status import JobStatus

#: The name under which an eval's accuracy is written (files, the job API's metrics).
EVAL_ACCURACY = "eval_accuracy"
#: The name of a supervised eval's held-out loss.
EVAL_LOSS = "eval_loss"


@dataclass(frozen=True, slots=True)
class StepMetrics:
    """The figures of one optimizer step of one tenant. Every step has the common
    figures; a GRPO step has the RL ones, a supervised step `token_accuracy` (RL
    figures it does not have are None, never made up)."""

    #: The step's loss: GRPO's surrogate, or a supervised step's mean token NLL.
    loss: float
    tokens: float
    rows: float
    grad_norm: float
    lr: float
    #: Seconds since the tenant's previous step ended (or its setup).
    step_time_s: float
    #: Seconds from handing the batch to the device to its result.
    train_wait_s: float
    #: Mean and standard deviation of the step's rewards (over all G x P samples).
    reward_mean: float | None = None
    reward_std: float | None = None
    #: Rows the step ran: a GRPO step skips rows of advantage 0 (without a KL term) and
    #: runs copies once (`train.grpo`); `clip_frac`, `ratio_mean`, `kl_behaviour` and
    #: `entropy` are over those rows' tokens, `tokens` and `rows` are the batch's.
    rows_trained: float | None = None
    #: Fraction of tokens whose importance ratio was clipped.
    clip_frac: float | None = None
    ratio_mean: float | None = None
    #: KL between the behaviour policy and the current one, per token.
    kl_behaviour: float | None = None
    entropy: float | None = None
    #: Versions between the trained adapter and the oldest / the mean sample.
    staleness_max: float | None = None
    staleness_mean: float | None = None
    #: KL to the base model, when the algorithm computes it.
    kl_base: float | None = None
    #: Supervised: fraction of trained tokens whose target was the most likely token.
    token_accuracy: float | None = None

    def as_dict(self) -> dict[str, float]:
        """The figures by name, as files and the service's database store them."""
        return {k: float(v) for k, v in asdict(self).items() if v is not None}


class _Record:
    __slots__ = ()
    _EVENT: ClassVar[str]

    @property
    def event(self) -> str:
        """The record's name in logs (`events.jsonl`, the trace, the summary)."""
        return self._EVENT

    def log_fields(self) -> dict[str, object]:
        """The record's fields for a log line (the tenant is logged on its own)."""
        fields = asdict(self)  # type: ignore[call-overload]
        fields.pop("tenant", None)
        return {k: str(v) if isinstance(v, Path) else v for k, v in fields.items()}


@dataclass(frozen=True, slots=True)
class TenantQueued(_Record):
    """The job was submitted and waits for admission."""

    _EVENT: ClassVar[str] = "tenant_queued"
    tenant: str
    total_steps: int
    priority: float = 0.0


@dataclass(frozen=True, slots=True)
class TenantStarted(_Record):
    """The tenant was admitted and runs."""

    _EVENT: ClassVar[str] = "tenant_admitted"
    tenant: str


@dataclass(frozen=True, slots=True)
class TenantPaused(_Record):
    """The tenant stopped launching work. `admitted`: it was running (else it was
    taken out of the admission queue and stays queued)."""

    _EVENT: ClassVar[str] = "tenant_paused"
    tenant: str
    admitted: bool


@dataclass(frozen=True, slots=True)
class TenantUnpaused(_Record):
    """A pause was undone: the tenant runs again (`admitted`) or is queued again."""

    _EVENT: ClassVar[str] = "tenant_unpaused"
    tenant: str
    admitted: bool


@dataclass(frozen=True, slots=True)
class TenantRestored(_Record):
    """The tenant was restored from its checkpoint at `version` (at `path`)."""

    _EVENT: ClassVar[str] = "tenant_restored"
    tenant: str
    version: int
    path: Path


@dataclass(frozen=True, slots=True)
class StepDone(_Record):
    """Optimizer step `step` (1-based: the adapter version it made) finished."""

    _EVENT: ClassVar[str] = "step"
    tenant: str
    step: int
    metrics: StepMetrics


@dataclass(frozen=True, slots=True)
class EvalDone(_Record):
    """Held-out figures of adapter `version`: an RL tenant's greedy accuracy (mean
    reward); a supervised tenant's token accuracy and `loss` (mean token NLL)."""

    _EVENT: ClassVar[str] = "eval"
    tenant: str
    version: int
    accuracy: float
    loss: float | None = None

    def as_dict(self) -> dict[str, float]:
        """The figures by name, as files and the service's database store them."""
        out = {EVAL_ACCURACY: self.accuracy}
        if self.loss is not None:
            out[EVAL_LOSS] = self.loss
        return out


@dataclass(frozen=True, slots=True)
class CheckpointWritten(_Record):
    """A complete checkpoint of `version` lies at `path`, its PEFT adapter at
    `adapter_path` (inside it). `step`: the figures of the step that made `version`,
    and `eval_accuracy` that version's eval, when known as the checkpoint was written."""

    _EVENT: ClassVar[str] = "checkpoint"
    tenant: str
    version: int
    path: Path
    adapter_path: Path
    step: StepMetrics | None = None
    eval_accuracy: float | None = None
    eval_loss: float | None = None

    @property
    def metrics(self) -> dict[str, float]:
        """The figures a checkpoint's record keeps (`checkpoint_metrics`)."""
        return checkpoint_metrics(self.step, self.eval_accuracy, self.eval_loss)

    def log_fields(self) -> dict[str, object]:
        return {"version": self.version, "path": str(self.path)}


def checkpoint_metrics(
    step: StepMetrics | None, eval_accuracy: float | None, eval_loss: float | None
) -> dict[str, float]:
    """The figures a checkpoint's record keeps: reward, loss, entropy (RL), token
    accuracy (supervised), eval."""
    out: dict[str, float] = {}
    if step is not None:
        kept = {
            "reward_mean": step.reward_mean,
            "reward_std": step.reward_std,
            "loss": step.loss,
            "entropy": step.entropy,
            "token_accuracy": step.token_accuracy,
        }
        out.update({k: v for k, v in kept.items() if v is not None})
    if eval_accuracy is not None:
        out[EVAL_ACCURACY] = eval_accuracy
    if eval_loss is not None:
        out[EVAL_LOSS] = eval_loss
    return out


@dataclass(frozen=True, slots=True)
class TenantEnded(_Record):
    """The tenant reached a terminal status. `stopped`: it was cancelled by the
    pipeline's graceful close (after its checkpoint), not by anyone's `cancel`."""

    tenant: str
    status: JobStatus
    reason: str | None
    stopped: bool = False

    @property
    def event(self) -> str:
        return "tenant_stopped" if self.stopped else f"tenant_{self.status}"


Progress = (
    TenantQueued
    | TenantStarted
    | TenantPaused
    | TenantUnpaused
    | TenantRestored
    | StepDone
    | EvalDone
    | CheckpointWritten
    | TenantEnded
)


def status_after(record: Progress, current: JobStatus | None) -> JobStatus | None:
    """The tenant's status once `record` happened, from `current` (None: unknown)."""
    if isinstance(record, TenantQueued):
        return JobStatus.QUEUED
    if isinstance(record, TenantStarted):
        return JobStatus.RUNNING
    if isinstance(record, TenantPaused) and record.admitted:
        return JobStatus.PAUSED
    if isinstance(record, TenantUnpaused) and record.admitted:
        return JobStatus.RUNNING
    if isinstance(record, TenantEnded):
        return record.status
    return current
