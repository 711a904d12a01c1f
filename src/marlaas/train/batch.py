"""Train batches: one tenant's data for one optimizer step, and how the trainer turns the
batches of many tenants into padded rows and token-bounded micro-batches.

A row is one trajectory as a next-token problem: the model reads `prompt + tokens[:-1]`
and position `t` predicts `(prompt + tokens)[t + 1]`. Only targets that the model wrote
(`loss_mask_T == 1`) are valid: prompt and tool-output targets never carry gradient.
A row is cut after its last valid target (later positions cannot influence earlier
ones under causal attention), and a row without any valid target is not run at all.

Invariants:
- A `TrainBatch` belongs to one tenant and one optimizer step; its advantages are the
  group-relative advantages of its rewards, one per trajectory.
- Token weights are computed over a tenant's *whole* step batch (`token_weights`), so
  however rows are split into micro-batches, and whoever they share them with, each
  tenant's loss is exactly its full-batch loss.
- Every micro-batch's padded size (rows x longest row) is at most the token budget, and
  its rows are grouped by tenant (lanes in batch order), so each tenant's rows are one
  contiguous slice.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import fmean, pstdev

import torch
from torch import Tensor

from marlaas.errors import DataError
from marlaas.packing import pack_longest_first
from marlaas.train.advantages import group_advantages
from marlaas.train.losses import LossNorm, token_weights
from marlaas.types import Trajectory


class TrainBatchError(DataError):
    """A tenant's train batch cannot be used; `tenant` names whose work to fail."""

    def __init__(self, tenant: str, message: str) -> None:
        super().__init__(f"tenant {tenant!r}: {message}")
        self.tenant = tenant


@dataclass(frozen=True)
class TrainBatch:
    """The trajectories of one optimizer step of one tenant, with their advantages.

    `step` is the optimizer step the batch is for, i.e. the tenant's adapter version
    before the update. Build it with `from_groups` so the advantages are group-relative.
    """

    tenant: str
    step: int
    trajectories: tuple[Trajectory, ...]
    advantages: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.trajectories:
            raise TrainBatchError(self.tenant, "a train batch needs at least one trajectory")
        if len(self.advantages) != len(self.trajectories):
            raise TrainBatchError(self.tenant, "need exactly one advantage per trajectory")
        if self.step < 0:
            raise TrainBatchError(self.tenant, f"step must be >= 0, got {self.step}")
        for i, traj in enumerate(self.trajectories):
            if traj.tenant != self.tenant:
                raise TrainBatchError(
                    self.tenant, f"trajectory {i} belongs to tenant {traj.tenant!r}"
                )
            if not traj.prompt_ids:
                raise TrainBatchError(
                    self.tenant, f"trajectory {i} ({traj.example_id}) has an empty prompt"
                )

    @classmethod
    def from_groups(
        cls,
        tenant: str,
        step: int,
        groups: Sequence[Sequence[Trajectory]],
        *,
        scale_rewards: bool,
    ) -> TrainBatch:
        """A batch from GRPO groups (each: the samples of one prompt), advantages by
        `group_advantages` within each group."""
        sizes = {len(g) for g in groups}
        if not groups or 0 in sizes:
            raise TrainBatchError(tenant, "need at least one non-empty group")
        if len(sizes) == 1:
            rewards_NG = torch.tensor([[t.reward for t in g] for g in groups], dtype=torch.float64)
            advantages = group_advantages(rewards_NG, scale=scale_rewards).flatten().tolist()
        else:  # ragged groups (a dropped sample): one call per group
            advantages = [
                a
                for g in groups
                for a in group_advantages(
                    torch.tensor([t.reward for t in g], dtype=torch.float64), scale=scale_rewards
                ).tolist()
            ]
        trajectories = tuple(t for g in groups for t in g)
        return cls(tenant, step, trajectories, tuple(float(a) for a in advantages))

    def staleness(self) -> tuple[int, ...]:
        """Per trajectory: `step - min_version`, how many updates old its oldest turn is."""
        return tuple(self.step - t.min_version for t in self.trajectories)

    @property
    def max_staleness(self) -> int:
        return max(self.staleness())

    @property
    def mean_staleness(self) -> float:
        s = self.staleness()
        return sum(s) / len(s)

    @property
    def rewards(self) -> tuple[float, ...]:
        return tuple(t.reward for t in self.trajectories)


#: Columns of the trainer's per-tenant sums over micro-batches (see `from_sums`).
LOSS, TOKENS, CLIPPED, RATIO, KL_BEHAVIOUR, KL_BASE, ENTROPY = range(7)
NUM_SUMS = 7


@dataclass(frozen=True)
class TenantStepResult:
    """What one optimizer step did for one tenant. Means are over its valid tokens."""

    tenant: str
    version: int  # the new adapter version
    loss: float
    clip_frac: float
    ratio_mean: float
    kl_base: float | None  # KL(pi || base) by the tenant's kl_estimator, if kl_coef > 0
    kl_behaviour: float  # k3 estimate of KL(mu || pi), behaviour vs current policy
    entropy: float  # of the current policy at the sampling temperature
    reward_mean: float
    reward_std: float
    advantage_mean: float
    advantage_std: float
    tokens: int
    rows: int
    staleness_max: int
    staleness_mean: float
    grad_norm: float  # before clipping
    lr: float

    @classmethod
    def from_sums(
        cls,
        batch: TrainBatch,
        version: int,
        sums: Sequence[float],
        grad_norm: float,
        lr: float,
        has_kl: bool,
    ) -> TenantStepResult:
        """Token-weighted means from the step's sums; batch statistics from `batch`."""
        n = max(sums[TOKENS], 1.0)
        staleness = batch.staleness()
        return cls(
            tenant=batch.tenant,
            version=version,
            loss=sums[LOSS],
            clip_frac=sums[CLIPPED] / n,
            ratio_mean=sums[RATIO] / n if sums[TOKENS] > 0 else 1.0,
            kl_base=sums[KL_BASE] / n if has_kl else None,
            kl_behaviour=sums[KL_BEHAVIOUR] / n,
            entropy=sums[ENTROPY] / n,
            reward_mean=fmean(batch.rewards),
            reward_std=pstdev(batch.rewards),
            advantage_mean=fmean(batch.advantages),
            advantage_std=pstdev(batch.advantages),
            tokens=round(sums[TOKENS]),
            rows=len(batch.trajectories),
            staleness_max=max(staleness),
            staleness_mean=fmean(staleness),
            grad_norm=grad_norm,
            lr=lr,
        )


@dataclass(frozen=True)
class Rows:
    """The rows of one trainer step (all tenants), right-padded to `T`, on the CPU.

    `tenant_N` indexes the step's batches; `lengths_N` is the number of positions run
    (0 for a row without valid targets); `weights_NT` is each token's weight in its
    tenant's loss; `prompt_N` numbers the distinct (tenant, prompt) pairs, so rows with
    the same number start with the same `prompt_len_N` tokens (a GRPO group).
    """

    input_ids_NT: Tensor
    target_ids_NT: Tensor
    mask_NT: Tensor
    behaviour_NT: Tensor
    weights_NT: Tensor
    advantages_N: Tensor
    lengths_N: Tensor
    tenant_N: Tensor
    prompt_N: Tensor
    prompt_len_N: Tensor


def tensorise(
    batches: Sequence[TrainBatch], norms: Sequence[tuple[LossNorm, float | None]]
) -> Rows:
    """Rows of every batch, in batch order; `norms[k]` is batch k's loss normalisation
    (`loss_norm`, `constant_norm_tokens`)."""
    trajs = [t for b in batches for t in b.trajectories]
    # Position t of a row predicts (prompt + tokens)[t + 1]: P - 1 prompt targets first.
    full_lengths = [len(t.prompt_ids) - 1 + len(t.token_ids) for t in trajs]
    N, T = len(trajs), max([*full_lengths, 1])
    valid_NT = torch.arange(T) < torch.tensor(full_lengths)[:, None]
    chain = itertools.chain.from_iterable

    def fill(values: Sequence[Sequence[float]], dtype: torch.dtype) -> Tensor:
        out = torch.zeros(N, T, dtype=dtype)
        out[valid_NT] = torch.tensor(list(chain(values)), dtype=dtype)
        return out

    input_ids = fill([(*t.prompt_ids, *t.token_ids)[:-1] for t in trajs], torch.long)
    target_ids = fill([(*t.prompt_ids[1:], *t.token_ids) for t in trajs], torch.long)
    pad = [(0,) * (len(t.prompt_ids) - 1) for t in trajs]
    mask_NT = fill([(*p, *t.loss_mask_T) for p, t in zip(pad, trajs, strict=True)], torch.long)
    mask_NT = mask_NT != 0
    behaviour_NT = fill(
        [(*p, *t.logprobs_T) for p, t in zip(pad, trajs, strict=True)], torch.float32
    )
    counts = [len(b.trajectories) for b in batches]
    tenant_N = torch.repeat_interleave(torch.arange(len(batches)), torch.tensor(counts))
    weights_NT = torch.cat(
        [
            token_weights(m, norm, constant_norm_tokens=const)
            for m, (norm, const) in zip(torch.split(mask_NT, counts), norms, strict=True)
        ]
    )
    # Cut each row after its last valid target: a later position never affects it.
    last_N = torch.where(mask_NT, torch.arange(1, T + 1), 0).amax(dim=1)
    prompts: dict[tuple[int, tuple[int, ...]], int] = {}
    prompt_N = [
        prompts.setdefault((k, t.prompt_ids), len(prompts))
        for k, b in enumerate(batches)
        for t in b.trajectories
    ]
    return Rows(
        input_ids_NT=input_ids,
        target_ids_NT=target_ids,
        mask_NT=mask_NT,
        behaviour_NT=behaviour_NT,
        weights_NT=weights_NT,
        advantages_N=torch.tensor([a for b in batches for a in b.advantages], dtype=torch.float32),
        lengths_N=last_N,
        tenant_N=tenant_N,
        prompt_N=torch.tensor(prompt_N, dtype=torch.long),
        prompt_len_N=torch.tensor([len(t.prompt_ids) for t in trajs], dtype=torch.long),
    )


def check_rows(batches: Sequence[TrainBatch], rows: Rows, vocab: int, max_tokens: int) -> None:
    """Reject a tenant's data that would fail (or poison) the shared forward."""
    K = len(batches)
    ids_N = torch.maximum(rows.input_ids_NT.amax(1), rows.target_ids_NT.amax(1))
    neg_N = (rows.input_ids_NT.amin(1) < 0) | (rows.target_ids_NT.amin(1) < 0)
    bad_lp_N = (rows.mask_NT & ~torch.isfinite(rows.behaviour_NT)).any(1)
    per_row_N4 = torch.stack([ids_N, neg_N.long(), bad_lp_N.long(), rows.lengths_N], 1)
    worst = torch.zeros(K, 4, dtype=torch.long).scatter_reduce_(
        0, rows.tenant_N[:, None].expand(-1, 4), per_row_N4, "amax"
    )
    for batch, (max_id, neg, bad_lp, length) in zip(batches, worst.tolist(), strict=True):
        if neg or max_id >= vocab:
            raise TrainBatchError(batch.tenant, f"token ids outside [0, {vocab})")
        if bad_lp:
            raise TrainBatchError(batch.tenant, "non-finite behaviour log-probs on model tokens")
        if length > max_tokens:
            raise TrainBatchError(
                batch.tenant,
                f"a trajectory of {length} tokens exceeds max_tokens_per_microbatch {max_tokens}",
            )


@dataclass(frozen=True)
class MicroBatch:
    """Rows run in one forward/backward: `rows_B` indexes `Rows`, grouped by tenant.

    Lane `l` is batch `lanes[l]`, on rows `offsets[l]:offsets[l + 1]`.
    """

    rows_B: Tensor
    length: int
    lane_B: Tensor
    lanes: tuple[int, ...]
    offsets: tuple[int, ...]

    @property
    def tokens(self) -> int:
        """Padded size, rows x length: what the budget bounds."""
        return int(self.rows_B.shape[0]) * self.length


def plan_microbatches(rows: Rows, max_tokens: int) -> list[MicroBatch]:
    """Pack the non-empty rows, longest first, into micro-batches of at most
    `max_tokens` padded tokens each, none of a row shorter than `MIN_FILL` of the
    micro-batch's length (its first row's): `marlaas.packing`. Rows longer than the
    budget must be rejected before."""
    order = torch.argsort(-rows.lengths_N, stable=True)
    order = order[rows.lengths_N[order] > 0]
    lengths = rows.lengths_N[order].tolist()
    plans: list[MicroBatch] = []
    for start, end in pack_longest_first(lengths, max_tokens):
        rows_B = order[start:end]
        tenant_B = rows.tenant_N[rows_B]
        rows_B = rows_B[torch.argsort(tenant_B, stable=True)]
        lanes, counts = torch.unique_consecutive(rows.tenant_N[rows_B], return_counts=True)
        lane_B = torch.repeat_interleave(torch.arange(len(lanes)), counts)
        offsets = (0, *itertools.accumulate(counts.tolist()))
        plans.append(MicroBatch(rows_B, lengths[start], lane_B, tuple(lanes.tolist()), offsets))
    return plans
