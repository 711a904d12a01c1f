"""A GRPO step in terms of the trainer's primitives: what the pipeline's train step is.

One optimizer step of one tenant is `forward_backward` of its batch (`TrainBatch` as
`Datum` rows, its advantages on every token, weights from the tenant's loss
normalisation over the whole batch, the `PolicyGradient` objective at the sampling
temperature) followed by `optim_step` with the tenant's AdamW parameters and schedule.

Not every row is run (`GRPOTraining.carried`), and the step's gradient, hence its
adapter, is still the one of every row run (tests); the objective's means in the result
are over the rows run:
- Rows of advantage 0: without a KL term every term of the objective is a multiple of
  its row's advantage, so such a row (a sample of a group whose samples were all
  rewarded alike: 51-67% of the rows of `bench paper`'s regimes at N = 32) adds exactly
  nothing to the gradient, while its tokens still count in the other rows' weights
  (`batch_data` weighs the whole batch).
- Copies: rows equal in tokens, behaviour log-probs and advantages (a group's samples
  that said the same thing: 44% of the compute regime's remaining rows, 18% of the paper
  regime's) have equal terms, and the loss is a sum weighted per token, so one of them
  runs with the sum of their weights.

`GRPOTraining` holds the per-tenant settings and makes those two calls' arguments, and
turns their results into a `TenantStepResult`; the pipeline sends them through the
device port, `GRPOTrainer` straight to an in-process `MultiLaneTrainer` (benchmarks and
tests).

`GRPOSnapshot` is what a GRPO tenant's checkpoint holds: the device's `TenantSnapshot`
and the `GRPOTraining` settings it was trained with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from marlaas.config.specs import GRPOSpec, LoRASpec
from marlaas.errors import ConfigError
from marlaas.model.lora import AdapterTensors, LoRAModel
from marlaas.train.batch import TenantStepResult, TrainBatch, TrainBatchError, batch_data
from marlaas.train.objectives import PolicyGradient
from marlaas.train.optim import AdamParams, AlgorithmSnapshot, TenantSnapshot
from marlaas.train.records import OptimResult, TrainInput, TrainOutput
from marlaas.train.trainer import MultiLaneTrainer, TrainerStats
from marlaas.types import Datum


@dataclass(frozen=True)
class GRPOTraining:
    """A tenant's GRPO settings: the algorithm, the rollouts' sampling temperature (the
    log-probs are computed at it; 1.0 for greedy), a linear learning-rate warmup, and
    `constant_norm_tokens`, required by `loss_norm="constant"` (Dr. GRPO: rows x max
    new tokens)."""

    algo: GRPOSpec
    temperature: float = 1.0
    warmup_steps: int = 0
    constant_norm_tokens: float | None = None

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ConfigError(
                f"temperature must be > 0 (use 1.0 for greedy), got {self.temperature}"
            )
        if self.algo.loss_norm == "constant" and self.constant_norm_tokens is None:
            raise ConfigError(
                "loss_norm='constant' needs constant_norm_tokens (rows per step x max new tokens)"
            )

    @property
    def objective(self) -> PolicyGradient:
        a = self.algo
        return PolicyGradient(
            clip_low=a.clip_low,
            clip_high=a.clip_high,
            tis_cap=a.tis_cap,
            kl_coef=a.kl_coef,
            kl_estimator=a.kl_estimator,
        )

    @property
    def adam(self) -> AdamParams:
        return AdamParams.from_spec(self.algo, self.warmup_steps)

    def train_input(self, batch: TrainBatch) -> TrainInput:
        """The `forward_backward` input of `batch` (for the adapter version `batch.step`).
        Raises `TrainBatchError` for trajectories beyond the tenant's staleness bound."""
        staleness = batch.staleness()
        if min(staleness) < 0:
            raise TrainBatchError(batch.tenant, "a trajectory has a version from the future")
        if max(staleness) > self.algo.max_staleness:
            raise TrainBatchError(
                batch.tenant,
                f"batch staleness {max(staleness)} exceeds max_staleness {self.algo.max_staleness}",
            )
        data = batch_data(batch, self.algo.loss_norm, self.constant_norm_tokens)
        return TrainInput(
            tenant=batch.tenant,
            data=self.carried(data),
            loss=self.objective,
            temperature=self.temperature,
            version=batch.step,
        )

    def carried(self, data: tuple[Datum, ...]) -> tuple[Datum, ...]:
        """The rows of `data` to run (the module doc): without a KL term, those with a
        non-zero advantage; and each distinct row once, carrying the weights of its
        copies. The first row where none is left (a step's sums come from the rows run;
        its gradient is then 0)."""
        rows = data
        if self.algo.kl_coef == 0:
            rows = tuple(d for d in data if any(a != 0 for a in d.advantages_T))
        copies: dict[tuple[tuple[Any, ...], ...], list[Datum]] = {}
        for d in rows:
            key = (d.input_ids, d.target_ids, d.sampling_logprobs_T, d.advantages_T)
            copies.setdefault(key, []).append(d)
        merged = tuple(
            same[0] if len(same) == 1 else dataclasses.replace(same[0], weights_T=_summed(same))
            for same in copies.values()
        )
        return merged or data[:1]

    def result(self, batch: TrainBatch, out: TrainOutput, step: OptimResult) -> TenantStepResult:
        return TenantStepResult.from_sums(
            batch, step.version, out.sums, step.grad_norm, step.lr, self.algo.kl_coef > 0, out.rows
        )


def _summed(copies: list[Datum]) -> tuple[float, ...]:
    """The per-token sums of equal rows' weights (equal rows have equal lengths)."""
    return tuple(map(sum, zip(*(d.weights_T for d in copies), strict=True)))


@dataclass(frozen=True)
class GRPOSnapshot(AlgorithmSnapshot):
    """A GRPO tenant's whole state: what its checkpoint holds."""

    training: GRPOTraining

    @property
    def algo(self) -> GRPOSpec:
        return self.training.algo


class GRPOTrainer:
    """GRPO steps of many tenants on one in-process `MultiLaneTrainer`, synchronously:
    each `step` is one `forward_backward` over every batch, then one `optim_step`."""

    def __init__(self, model: LoRAModel, max_tokens_per_microbatch: int = 8192) -> None:
        self.trainer = MultiLaneTrainer(model, max_tokens_per_microbatch)
        self._training: dict[str, GRPOTraining] = {}

    @property
    def stats(self) -> TrainerStats:
        return self.trainer.stats

    def register(
        self,
        tenant: str,
        lora: LoRASpec,
        algo: GRPOSpec,
        tensors: AdapterTensors | None = None,
        seed: int = 0,
        temperature: float = 1.0,
        *,
        warmup_steps: int = 0,
        constant_norm_tokens: float | None = None,
    ) -> None:
        """Add a tenant at version 0 with `tensors` or a fresh PEFT-style init from
        `seed`, trained with these GRPO settings (see `GRPOTraining`)."""
        training = GRPOTraining(algo, temperature, warmup_steps, constant_norm_tokens)
        snapshot = None if tensors is None else TenantSnapshot(tenant, lora, 0, tensors)
        self.trainer.add(tenant, lora, seed=seed, snapshot=snapshot)
        self._training[tenant] = training

    def step(self, batches: Sequence[TrainBatch]) -> dict[str, TenantStepResult]:
        """One optimizer step for each batch's tenant, all in one pass over the base."""
        if not batches:
            return {}
        names = [b.tenant for b in batches]
        if len(set(names)) != len(names):
            raise ConfigError("a trainer step takes at most one batch per tenant")
        trainings = [self.training(b.tenant) for b in batches]
        inputs = [t.train_input(b) for t, b in zip(trainings, batches, strict=True)]
        outputs = self.trainer.forward_backward(inputs)
        steps = self.trainer.optim_step(
            [(b.tenant, t.adam) for t, b in zip(trainings, batches, strict=True)]
        )
        return {
            b.tenant: t.result(b, outputs[b.tenant], steps[b.tenant])
            for t, b in zip(trainings, batches, strict=True)
        }

    def training(self, tenant: str) -> GRPOTraining:
        self.trainer.version(tenant)  # TenantNotFound for an unknown tenant
        return self._training[tenant]

    def snapshot(self, tenant: str) -> GRPOSnapshot:
        return GRPOSnapshot(self.trainer.snapshot(tenant), self.training(tenant))

    def restore(self, snapshot: GRPOSnapshot) -> None:
        """Put a tenant (back) in exactly the state of `snapshot`, replacing it if present."""
        self.trainer.restore(snapshot.state)
        self._training[snapshot.tenant] = snapshot.training

    def remove(self, tenant: str) -> None:
        self.trainer.remove(tenant)
        del self._training[tenant]

    def tenants(self) -> list[str]:
        return self.trainer.tenants()

    def __contains__(self, tenant: object) -> bool:
        return tenant in self.trainer

    def version(self, tenant: str) -> int:
        return self.trainer.version(tenant)

    def adapter(self, tenant: str) -> AdapterTensors:
        return self.trainer.adapter(tenant)
