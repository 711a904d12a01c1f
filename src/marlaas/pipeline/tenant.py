"""One tenant's job as an explicit state machine: status, version, data cursor, group
accounting and the staleness-checked construction of train batches. Pure logic: no
asyncio, no torch compute, so every rule here is unit-testable on its own.

Status transitions follow the one job-status machine (`marlaas.status`); any other is
a bug and raises `PipelineError`. The pipeline takes: queued -> running (admitted),
running <-> paused (pause, unpause), running | paused -> done | failed | cancelled
(paused -> done: the last step was already trained when it paused), queued -> failed |
cancelled. A job paused before admission keeps its queued status: the orchestrator
holds it out of the admission queue until it is unpaused.

Group accounting (P = prompts_per_step, s = max_staleness, k = version):

- `in_flight` groups are being sampled, `buffered` groups are finished and waiting,
  `training` groups sit in the batch the device is training on now, `trained` groups
  went into finished optimizer steps, and dropped groups count nowhere.
- A new group may launch only while `in_flight + buffered + training < (s + 1) * P`
  (this bounds how far rollouts run ahead of the trainer) and while
  `trained + training + buffered + in_flight < steps * P` (no work past the last step).

Invariants:
- `version` is the number of optimizer steps done, and it goes up by exactly one per
  train result (`on_trained` rejects anything else).
- A batch built for step k only holds groups whose every trajectory has
  `min_version >= k - s` (and `<= k`). Stale groups are dropped when the batch is built
  (re-sampled through the launch rule), and the finished batch is checked again;
  a violation is counted in `stats.staleness_violations` and never trained on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from marlaas.config.job import JobSpec
from marlaas.errors import MarlaasError
from marlaas.status import JobStatus, can_move
from marlaas.train.batch import TenantStepResult, TrainBatch
from marlaas.types import Trajectory


class PipelineError(MarlaasError, RuntimeError):
    """The pipeline reached a state it must never reach (a bug, or misuse of its API)."""


class TenantFailure(MarlaasError, RuntimeError):
    """A tenant's own work failed for good; the tenant is failed, nobody else is."""


@dataclass
class TenantStats:
    """Counters of one tenant over this run (a resumed run starts them afresh)."""

    groups_launched: int = 0
    groups_trained: int = 0
    groups_dropped_stale: int = 0
    staleness_violations: int = 0
    staleness_max: int = 0
    staleness_sum: int = 0
    staleness_count: int = 0
    episode_retries: int = 0
    tokens_trained: int = 0
    steps_this_run: int = 0
    #: Eval accuracy by the adapter version it was measured at (carried across resumes).
    eval_accuracy: dict[int, float] = field(default_factory=dict)

    @property
    def staleness_mean(self) -> float:
        return self.staleness_sum / self.staleness_count if self.staleness_count else 0.0


class TenantState:
    """Where one tenant's job stands; see the module docstring for the rules."""

    def __init__(self, job: JobSpec, *, order: int = 0) -> None:
        self.job = job
        self.name = job.name
        #: Position in submission order (admission is FIFO within a priority).
        self.order = order
        self.status = JobStatus.QUEUED
        self.reason: str | None = None
        self.version = 0
        self.cursor = 0
        self.in_flight = 0
        self.buffer: list[tuple[Trajectory, ...]] = []
        self.training = 0
        self.trained = 0
        #: Work that must finish before the next step trains (a checkpoint's snapshot).
        self.holds = 0
        self.stats = TenantStats()

    # -- knobs -----------------------------------------------------------------------

    @property
    def prompts_per_step(self) -> int:
        return self.job.grpo.prompts_per_step

    @property
    def group_size(self) -> int:
        return self.job.grpo.group_size

    @property
    def max_staleness(self) -> int:
        return self.job.grpo.max_staleness

    @property
    def steps(self) -> int:
        return self.job.steps

    @property
    def finished_training(self) -> bool:
        return self.version >= self.steps

    # -- status ----------------------------------------------------------------------

    def transition(self, status: JobStatus, reason: str | None = None) -> None:
        if not can_move(self.status, status):
            raise PipelineError(f"tenant {self.name!r}: cannot go from {self.status} to {status}")
        self.status = status
        if reason is not None:
            self.reason = reason

    def restore(self, version: int, cursor: int) -> None:
        """Continue from a checkpoint: `version` steps done, `cursor` prompts consumed."""
        if self.version or self.cursor or self.outstanding or self.status.terminal:
            raise PipelineError(f"tenant {self.name!r}: restore only a tenant that has not started")
        if version < 0 or cursor < 0:
            raise PipelineError(f"tenant {self.name!r}: bad checkpoint ({version=}, {cursor=})")
        self.version = version
        # Groups trained (RL accounting); a supervised tenant counts examples in `cursor`.
        self.trained = 0 if self.job.supervised else version * self.prompts_per_step
        self.cursor = cursor

    # -- groups ----------------------------------------------------------------------

    @property
    def outstanding(self) -> int:
        """Groups sampled or being sampled but not yet trained on."""
        return self.in_flight + len(self.buffer) + self.training

    def can_launch(self) -> bool:
        if self.status is not JobStatus.RUNNING:
            return False
        P = self.prompts_per_step
        ahead = self.outstanding < (self.max_staleness + 1) * P
        within = self.trained + self.outstanding < self.steps * P
        return ahead and within

    def launch(self) -> int:
        """Account one new group; returns its data index (the cursor before it)."""
        if not self.can_launch():
            raise PipelineError(f"tenant {self.name!r}: launched a group past its bound")
        index = self.cursor
        self.cursor += 1
        self.in_flight += 1
        self.stats.groups_launched += 1
        return index

    def group_done(self, group: Sequence[Trajectory]) -> None:
        if self.in_flight < 1:
            raise PipelineError(f"tenant {self.name!r}: a group finished that never started")
        self.in_flight -= 1
        if any(t.tenant != self.name for t in group) or not group:
            raise PipelineError(f"tenant {self.name!r}: got an empty or foreign group")
        self.buffer.append(tuple(group))

    def group_lost(self) -> None:
        """An in-flight group will not finish (its task was cancelled or failed)."""
        self.in_flight = max(self.in_flight - 1, 0)

    # -- batches ---------------------------------------------------------------------

    def can_train(self) -> bool:
        return (
            self.status is JobStatus.RUNNING
            and not self.training
            and not self.holds
            and not self.finished_training
        )

    def _fresh(self, group: Sequence[Trajectory]) -> bool:
        k, s = self.version, self.max_staleness
        return all(k - s <= t.min_version <= k for t in group)

    def take_batch(self) -> TrainBatch | None:
        """The train batch for step `version` if P fresh groups are buffered, else None.

        Stale groups are dropped first (their prompts are re-sampled through the launch
        rule). The oldest fresh groups go first: they are the next to turn stale.
        """
        if not self.can_train():
            return None
        fresh = [g for g in self.buffer if self._fresh(g)]
        self.stats.groups_dropped_stale += len(self.buffer) - len(fresh)
        fresh.sort(key=lambda g: min(t.min_version for t in g))  # stable: FIFO on ties
        P = self.prompts_per_step
        if len(fresh) < P:
            self.buffer = fresh
            return None
        chosen, self.buffer = fresh[:P], fresh[P:]
        batch = TrainBatch.from_groups(
            self.name,
            self.version,
            chosen,
            scale_rewards=self.job.grpo.scale_rewards,
        )
        staleness = batch.staleness()
        if min(staleness) < 0 or max(staleness) > self.max_staleness:
            # Unreachable by construction; counted (tests pin zero) and never trained on.
            self.stats.staleness_violations += 1
            self.stats.groups_dropped_stale += P
            return None
        self.training = P
        return batch

    def on_trained(self, batch: TrainBatch, result: TenantStepResult) -> None:
        """Account a finished optimizer step of `batch`."""
        if not self.training or batch.step != self.version:
            raise PipelineError(f"tenant {self.name!r}: a train result nobody waited for")
        if result.version != self.version + 1:
            raise PipelineError(
                f"tenant {self.name!r}: trainer returned version {result.version} after "
                f"step {self.version}; versions go up by exactly one per step"
            )
        self.version = result.version
        self.trained += self.training
        self.stats.groups_trained += self.training
        self.training = 0
        self.stats.steps_this_run += 1
        self.stats.tokens_trained += result.tokens
        staleness = batch.staleness()
        self.stats.staleness_max = max(self.stats.staleness_max, max(staleness))
        self.stats.staleness_sum += sum(staleness)
        self.stats.staleness_count += len(staleness)

    def advance(self, version: int, examples: int, tokens: int) -> None:
        """Account a supervised step: `examples` more consumed, trained to `version`."""
        if version != self.version + 1:
            raise PipelineError(
                f"tenant {self.name!r}: trainer returned version {version} after step "
                f"{self.version}; versions go up by exactly one per step"
            )
        self.version = version
        self.cursor += examples
        self.stats.steps_this_run += 1
        self.stats.tokens_trained += tokens

    def train_failed(self) -> None:
        """The batch in training was rejected; its groups are gone."""
        self.training = 0


def describe_failure(exc: BaseException) -> str:
    """A failure reason a person can act on: the error and its root cause."""
    text = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__
    if cause is not None and str(cause) not in text:
        text += f" (caused by {type(cause).__name__}: {cause})"
    return text
