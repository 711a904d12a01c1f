"""The rows of a training pass: many tenants' data right-padded into one set of tensors
(`Rows`, made per input by `tensorise_data` where the input is made and joined by
`concat_rows` in the pass), checked before the shared forward (`check_rows`), and split
into token-bounded micro-batches (`plan_microbatches`). A tenant's data itself:
`marlaas.train.batch`.

A row is cut after its last weighted position (later positions cannot influence earlier
ones under causal attention), and a row without any is not run.

Invariants:
- Every micro-batch's padded size (rows x longest row) is at most the token budget, and
  its rows are grouped by tenant (lanes in batch order), so each tenant's rows are one
  contiguous slice.
- The rows of one prompt (a GRPO group) that fit the budget together are in one
  micro-batch, so that the prompt runs once for all of them (`marlaas.train.prefix`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from marlaas.packing import MIN_FILL, PrefixGroup, pack_longest_first, pack_prefix_groups
from marlaas.train.batch import TrainBatch, TrainBatchError, batch_data, flat_tensor
from marlaas.train.losses import LossNorm
from marlaas.types import Datum


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
