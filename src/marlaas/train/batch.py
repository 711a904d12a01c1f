"""Train batches and rows: a GRPO tenant's data for one optimizer step (`TrainBatch`,
turned into `Datum` rows by `batch_data`), and how the trainer turns the data of many
tenants into padded rows and token-bounded micro-batches.

A datum is one next-token problem: the model reads `input_ids` and position `t` is
scored on `target_ids[t]` with weight `weights_T[t]`. A GRPO trajectory is the row
`prompt + tokens[:-1]` predicting `(prompt + tokens)[1:]`, weighted only on the tokens
the model wrote (`loss_mask_T == 1`): prompt and tool-output targets never carry
gradient. A row is cut after its last weighted position (later positions cannot
influence earlier ones under causal attention), and a row without any is not run.

Invariants:
- A `TrainBatch` belongs to one tenant and one optimizer step; its advantages are the
  group-relative advantages of its rewards, one per trajectory.
- GRPO token weights are computed over a tenant's *whole* step batch (`token_weights`
  in `batch_data`), so however rows are split into micro-batches or calls, and whoever
  they share them with, each tenant's loss is exactly its full-batch loss.
- Every micro-batch's padded size (rows x longest row) is at most the token budget, and
  its rows are grouped by tenant (lanes in batch order), so each tenant's rows are one
  contiguous slice.
- The rows of one prompt (a GRPO group) that fit the budget together are in one
  micro-batch, so that the prompt runs once for all of them (`marlaas.train.prefix`).
"""

from __future__ import annotations

import array
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import fmean

import torch
from torch import Tensor

from marlaas.errors import DataError
from marlaas.packing import MIN_FILL, PrefixGroup, pack_longest_first, pack_prefix_groups
from marlaas.train.advantages import group_advantages
from marlaas.train.losses import LossNorm, token_weights
from marlaas.types import Datum, Trajectory


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

    @property
    def tokens(self) -> int:
        """The tokens the model wrote (loss mask 1): the positions a step trains on."""
        return sum(sum(t.loss_mask_T) for t in self.trajectories)


#: The `array` type codes of the dtypes `flat_tensor` builds through one.
_ARRAY_CODES = {torch.long: "q", torch.float32: "f"}


def flat_tensor(values: list[float], dtype: torch.dtype) -> Tensor:
    """`torch.tensor(values, dtype=dtype)` of a flat list of Python numbers, through an
    `array` of C numbers for int64 and float32 (the same values: each rounded as
    `torch.tensor` rounds it), which torch takes whole where `torch.tensor` looks at
    each element: a 64-row GRPO group's training input (~4,000 numbers a field) made
    1.5-1.7x faster, on the event loop, per tenant and step. Values the array refuses
    (a float for int64, an int past its range) go to `torch.tensor`, which converts or
    refuses them as it always did."""
    code = _ARRAY_CODES.get(dtype)
    if code is not None and values:
        try:
            return torch.frombuffer(array.array(code, values), dtype=dtype)
        except (TypeError, OverflowError):
            pass
    return torch.tensor(values, dtype=dtype)


def batch_data(
    batch: TrainBatch, loss_norm: LossNorm, constant_norm_tokens: float | None = None
) -> tuple[Datum, ...]:
    """The rows of a GRPO batch as data: each trajectory's prompt and tokens as one
    next-token row, its advantage on every token, its behaviour log-probs, and weights
    from `token_weights` over the whole batch (so the batch's loss is its normalised
    loss however it is split; prompt and tool-output targets weigh 0)."""
    trajs = batch.trajectories
    masks = [(0,) * (len(t.prompt_ids) - 1) + tuple(t.loss_mask_T) for t in trajs]
    lengths = torch.tensor([len(m) for m in masks])
    valid_NT = torch.arange(int(lengths.max())) < lengths[:, None]
    mask_NT = torch.zeros(valid_NT.shape, dtype=torch.bool)
    mask_NT[valid_NT] = flat_tensor(list(itertools.chain.from_iterable(masks)), torch.long) != 0
    weights_NT = token_weights(mask_NT, loss_norm, constant_norm_tokens=constant_norm_tokens)
    out: list[Datum] = []
    for t, m, w_T, adv in zip(trajs, masks, weights_NT.tolist(), batch.advantages, strict=True):
        n = len(m)
        out.append(
            Datum(
                input_ids=(*t.prompt_ids, *t.token_ids)[:-1],
                target_ids=(*t.prompt_ids[1:], *t.token_ids),
                weights_T=tuple(w_T[:n]),
                sampling_logprobs_T=(0.0,) * (len(t.prompt_ids) - 1) + tuple(t.logprobs_T),
                advantages_T=(float(adv),) * n,
            )
        )
    return tuple(out)


@dataclass(frozen=True)
class TenantStepResult:
    """What one GRPO optimizer step did for one tenant. `tokens` and `rows` are the
    batch's (its valid tokens, its trajectories); the objective's means (`clip_frac`,
    `ratio_mean`, the KLs, `entropy`) are over the valid tokens of the rows it was run on,
    `rows_trained` of them (`GRPOTraining.carried`: rows of advantage 0 carry no gradient
    and are not run)."""

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
    rows_trained: int

    @classmethod
    def from_sums(
        cls,
        batch: TrainBatch,
        version: int,
        sums: Mapping[str, float],
        grad_norm: float,
        lr: float,
        has_kl: bool,
        rows_trained: int,
    ) -> TenantStepResult:
        """Token-weighted means from the step's sums (the names of
        `objectives.PolicyGradient`; missing ones count 0) over the `rows_trained` rows
        they were summed on; batch statistics from `batch`."""
        tokens = sums.get("tokens", 0.0)
        n = max(tokens, 1.0)
        staleness = batch.staleness()
        return cls(
            tenant=batch.tenant,
            version=version,
            loss=sums.get("loss", 0.0),
            clip_frac=sums.get("clipped", 0.0) / n,
            ratio_mean=sums.get("ratio", 0.0) / n if tokens > 0 else 1.0,
            kl_base=sums.get("kl_base", 0.0) / n if has_kl else None,
            kl_behaviour=sums.get("kl_behaviour", 0.0) / n,
            entropy=sums.get("entropy", 0.0) / n,
            reward_mean=fmean(batch.rewards),
            reward_std=_pstdev(batch.rewards),
            advantage_mean=fmean(batch.advantages),
            advantage_std=_pstdev(batch.advantages),
            tokens=batch.tokens,
            rows=len(batch.trajectories),
            staleness_max=max(staleness),
            staleness_mean=fmean(staleness),
            grad_norm=grad_norm,
            lr=lr,
            rows_trained=rows_trained,
        )


def _pstdev(xs: Sequence[float]) -> float:
    """The population standard deviation of `xs` in floats (`statistics.pstdev` sums
    exact fractions: 21 us for a group of 4, 1.3 ms of a 32-tenant step's results)."""
    mean = fmean(xs)
    return math.sqrt(fmean([(x - mean) ** 2 for x in xs]))


@dataclass(frozen=True)
class Rows:
    """The rows of one training pass (all tenants), right-padded to `T`, on the CPU.

    `tenant_N` indexes the pass's inputs; `lengths_N` is the number of positions run (0
    for a row without weighted targets); `mask_NT` marks the weighted positions and
    `weights_NT` holds their weights; `behaviour_NT` the sampling log-probs and
    `advantages_NT` the advantages (0 where the data gave none); `prompt_N` numbers the
    distinct (tenant, prefix) pairs, so rows with the same number start with the same
    `prompt_len_N - 1` tokens before their first weighted position (a GRPO group).
    """

    input_ids_NT: Tensor
    target_ids_NT: Tensor
    mask_NT: Tensor
    behaviour_NT: Tensor
    weights_NT: Tensor
    advantages_NT: Tensor
    lengths_N: Tensor
    tenant_N: Tensor
    prompt_N: Tensor
    prompt_len_N: Tensor


def tensorise_data(data: Sequence[Sequence[Datum]], whole: Sequence[bool] | None = None) -> Rows:
    """Rows of every tenant's data, in order (`data[k]` is tenant k's). A row is cut
    after its last weighted position (later positions cannot change it) unless
    `whole[k]`: then every position is run, and none is shared with another row (the
    caller wants every position's log-prob)."""
    whole = list(whole) if whole is not None else [False] * len(data)
    rows = [d for tenant in data for d in tenant]
    whole_N = [w for tenant, w in zip(data, whole, strict=True) for _ in tenant]
    T = max([len(d.input_ids) for d in rows] + [1])

    def padded(values: Sequence[Sequence[float]], dtype: torch.dtype) -> Tensor:
        # One op a field from Python lists padded here (an input is made per tenant, on
        # the event loop: a dozen ops fewer than masks and scatters).
        zeros = (0,) * T
        flat: list[float] = []
        for v in values:
            flat += v
            flat += zeros[len(v) :]
        return flat_tensor(flat, dtype).view(len(values), T)

    def given(values: tuple[float, ...], d: Datum) -> tuple[float, ...]:
        return values or (0.0,) * len(d.input_ids)

    input_ids = padded([d.input_ids for d in rows], torch.long)
    target_ids = padded([d.target_ids for d in rows], torch.long)
    weights_NT = padded([d.weights_T for d in rows], torch.float32)
    behaviour_NT = padded([given(d.sampling_logprobs_T, d) for d in rows], torch.float32)
    advantages_NT = padded([given(d.advantages_T, d) for d in rows], torch.float32)
    mask_NT = weights_NT != 0
    # Per row: the positions run (after its last weighted one, or all where whole) and
    # its first weighted position (T where none).
    lengths: list[int] = []
    first_N: list[int] = []
    for d, w in zip(rows, whole_N, strict=True):
        # The first weighted position from the start, the last from the end (a row's
        # prompt's zeros come first: most of the row is not scanned).
        w_T = d.weights_T
        first = next((t for t, x in enumerate(w_T) if x != 0), None)
        last = (
            None
            if first is None
            else next(t for t in range(len(w_T) - 1, first - 1, -1) if w_T[t] != 0)
        )
        full = len(d.input_ids)
        lengths.append(full if w and full > 0 else (0 if last is None else last + 1))
        first_N.append(T if first is None else first)
    lengths_N = torch.tensor(lengths, dtype=torch.long)
    tenants = [k for k, tenant in enumerate(data) for _ in tenant]
    tenant_N = torch.tensor(tenants, dtype=torch.long)
    prefixes: dict[tuple[int, tuple[int, ...]], int] = {}
    prompt_N: list[int] = []
    prompt_len_N: list[int] = []
    for i, (d, k, first) in enumerate(zip(rows, tenants, first_N, strict=True)):
        start = 0 if whole_N[i] else min(first, len(d.input_ids))
        key = (k, d.input_ids[:start]) if start > 0 else (k, (-1 - i,))  # -1 - i: its own
        prompt_N.append(prefixes.setdefault(key, len(prefixes)))
        prompt_len_N.append(start + 1)
    return Rows(
        input_ids_NT=input_ids,
        target_ids_NT=target_ids,
        mask_NT=mask_NT,
        behaviour_NT=behaviour_NT,
        weights_NT=weights_NT,
        advantages_NT=advantages_NT,
        lengths_N=lengths_N,
        tenant_N=tenant_N,
        prompt_N=torch.tensor(prompt_N, dtype=torch.long),
        prompt_len_N=torch.tensor(prompt_len_N, dtype=torch.long),
    )


def concat_rows(parts: Sequence[Rows]) -> Rows:
    """The rows of `parts` in order, as one `Rows` (padded to the longest; part k's
    rows of tenant k, their prompts numbered after the parts' before): what
    `tensorise_data` of the parts' data makes, from tensors each input made ahead
    (`TrainInput.rows`: the host's work, off the device's pass)."""
    if len(parts) == 1:
        return parts[0]
    N = sum(int(p.lengths_N.shape[0]) for p in parts)
    T = max(int(p.input_ids_NT.shape[1]) for p in parts)
    grids = {
        name: torch.zeros((N, T), dtype=getattr(parts[0], name).dtype)
        for name in ("input_ids_NT", "target_ids_NT", "behaviour_NT", "weights_NT", "advantages_NT")
    }
    at = 0
    for p in parts:
        n, t = (int(x) for x in p.input_ids_NT.shape)
        for name, grid in grids.items():
            grid[at : at + n, :t] = getattr(p, name)
        at += n
    offsets = itertools.accumulate((int(p.prompt_N.max()) + 1 for p in parts[:-1]), initial=0)
    return Rows(
        **grids,
        mask_NT=grids["weights_NT"] != 0,
        lengths_N=torch.cat([p.lengths_N for p in parts]),
        tenant_N=torch.cat([torch.full_like(p.tenant_N, k) for k, p in enumerate(parts)]),
        prompt_N=torch.cat([p.prompt_N + off for p, off in zip(parts, offsets, strict=True)]),
        prompt_len_N=torch.cat([p.prompt_len_N for p in parts]),
    )


def tensorise(
    batches: Sequence[TrainBatch], norms: Sequence[tuple[LossNorm, float | None]]
) -> Rows:
    """Rows of GRPO batches, in batch order; `norms[k]` is batch k's loss normalisation
    (`loss_norm`, `constant_norm_tokens`)."""
    return tensorise_data(
        [batch_data(b, norm, const) for b, (norm, const) in zip(batches, norms, strict=True)]
    )


def check_rows(tenants: Sequence[str], rows: Rows, vocab: int, max_tokens: int) -> None:
    """Reject a tenant's data that would fail (or poison) the shared forward."""
    K = len(tenants)
    ids_N = torch.maximum(rows.input_ids_NT.amax(1), rows.target_ids_NT.amax(1))
    neg_N = (rows.input_ids_NT.amin(1) < 0) | (rows.target_ids_NT.amin(1) < 0)
    finite_NT = torch.isfinite(rows.behaviour_NT) & torch.isfinite(rows.advantages_NT)
    bad_N = (rows.mask_NT & ~finite_NT).any(1) | ~torch.isfinite(rows.weights_NT).all(1)
    per_row_N4 = torch.stack([ids_N, neg_N.long(), bad_N.long(), rows.lengths_N], 1)
    worst = torch.zeros(K, 4, dtype=torch.long).scatter_reduce_(
        0, rows.tenant_N[:, None].expand(-1, 4), per_row_N4, "amax"
    )
    for tenant, (max_id, neg, bad, length) in zip(tenants, worst.tolist(), strict=True):
        if neg or max_id >= vocab:
            raise TrainBatchError(tenant, f"token ids outside [0, {vocab})")
        if bad:
            raise TrainBatchError(
                tenant, "non-finite weights, behaviour log-probs or advantages on model tokens"
            )
        if length > max_tokens:
            raise TrainBatchError(
                tenant,
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


#: Padded suffix tokens a micro-batch may take beyond the MIN_FILL bound, for groups of
#: short suffixes that would otherwise need a micro-batch of their own: on the embedded
#: base (CPU) another micro-batch costs about what 100 tokens do (its fixed cost of
#: about 8 ms for the two forwards and backwards, at about 0.085 ms a token).
SMALL_PADDING = 128


def plan_microbatches(rows: Rows, max_tokens: int, min_fill: float = MIN_FILL) -> list[MicroBatch]:
    """Micro-batches of at most `max_tokens` padded tokens each over the non-empty rows.

    Rows that share a prompt (`prompt_N`, a GRPO group) stay together, so the trainer
    can run the prompt once for all of them (`marlaas.train.prefix`): whole groups (a
    group too long for the budget cut into pieces that fit, longest rows first) and the
    rows that share their prompt with none are packed by their suffixes
    (`marlaas.packing.pack_prefix_groups`). Where no two rows share a prompt, and for
    rows without a prefix (the first position weighted, or every position asked for),
    rows are packed longest first, none shorter than `min_fill` of its micro-batch's
    length (`marlaas.packing.pack_longest_first`); `min_fill` bounds the suffixes'
    padding alike (lower it where the forward skips padding: fewer micro-batches). Rows
    longer than the budget must be rejected before."""
    lengths: list[int] = rows.lengths_N.tolist()
    starts: list[int] = (rows.prompt_len_N - 1).tolist()
    members: dict[int, list[int]] = {}
    for i, (prompt, n) in enumerate(zip(rows.prompt_N.tolist(), lengths, strict=True)):
        if n > 0:
            members.setdefault(prompt, []).append(i)
    pieces: list[list[int]] = []
    single: list[int] = []
    for group in members.values():
        if starts[group[0]] < 1:  # no prefix to run apart
            single += group
        else:
            pieces += _fitting(sorted(group, key=lambda i: -lengths[i]), lengths, max_tokens)
    if all(len(piece) == 1 for piece in pieces):  # nothing to share
        single += [i for piece in pieces for i in piece]
        pieces = []
    units = [PrefixGroup(starts[p[0]], tuple(lengths[i] - starts[i] for i in p)) for p in pieces]
    plans = [
        _micro(rows, [i for u in batch for i in pieces[u]])
        for batch in pack_prefix_groups(units, max_tokens, SMALL_PADDING, min_fill)
    ]
    single_N = torch.tensor(sorted(single), dtype=torch.long)
    order = single_N[torch.argsort(-rows.lengths_N[single_N], stable=True)]
    for start, end in pack_longest_first(rows.lengths_N[order].tolist(), max_tokens, min_fill):
        plans.append(_micro(rows, order[start:end].tolist()))
    return plans


def _fitting(group: list[int], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """`group` (longest row first) cut into consecutive pieces of at most `max_tokens`
    rows x longest row."""
    pieces: list[list[int]] = []
    for i in group:
        if pieces and (len(pieces[-1]) + 1) * lengths[pieces[-1][0]] <= max_tokens:
            pieces[-1].append(i)
        else:
            pieces.append([i])
    return pieces


def _micro(rows: Rows, members: Sequence[int]) -> MicroBatch:
    """The micro-batch of rows `members`, regrouped by tenant (lanes in batch order)."""
    rows_B = torch.tensor(members, dtype=torch.long)
    rows_B = rows_B[torch.argsort(rows.tenant_N[rows_B], stable=True)]
    lanes, counts = torch.unique_consecutive(rows.tenant_N[rows_B], return_counts=True)
    lane_B = torch.repeat_interleave(torch.arange(len(lanes)), counts)
    offsets = (0, *itertools.accumulate(counts.tolist()))
    length = int(rows.lengths_N[rows_B].max())
    return MicroBatch(rows_B, length, lane_B, tuple(lanes.tolist()), offsets)
