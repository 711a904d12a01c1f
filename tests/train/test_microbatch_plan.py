"""The micro-batch planner keeps a GRPO group's rows together so that its prompt runs once
(`marlaas.train.prefix`), within the token budget, each tenant's rows one slice."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from test_trainer import TENANTS, _register, _rel_diff
from torch import Tensor
from train_data import make_batch

from marlaas.config.specs import GRPOSpec
from marlaas.model.lora import LoRAModel
from marlaas.packing import MIN_FILL, PrefixGroup, pack_prefix_groups
from marlaas.train.batch import TrainBatch, batch_data, flat_tensor
from marlaas.train.grpo import GRPOTrainer
from marlaas.train.prefix import SharedPrefix
from marlaas.train.rows import (
    SMALL_PADDING,
    MicroBatch,
    Rows,
    concat_rows,
    plan_microbatches,
    tensorise,
    tensorise_data,
)
from marlaas.types import Datum


def _batches(tenants: int, seed: int, group_size: int = 4, prompts: int = 3) -> list[TrainBatch]:
    # model_copy: a group of 1 (no validation) stands for rows that share no prompt.
    algo = GRPOSpec(group_size=2).model_copy(
        update={"group_size": group_size, "prompts_per_step": prompts}
    )
    return [
        make_batch(
            f"u{k}",
            0,
            algo,
            seed=seed + k,
            prompt_len=(2 + 3 * (k % 4), 6 + 6 * (k % 4)),
            completion_len=(2, 6 + 5 * (k % 3)),
        )
        for k in range(tenants)
    ]


def _rows(batches: list[TrainBatch]) -> Rows:
    return tensorise(batches, [("token", None)] * len(batches))


def _check_plan(rows: Rows, plans: list[MicroBatch], budget: int) -> None:
    """Every non-empty row once; within the budget; lanes are contiguous tenant slices."""
    seen = Counter(i for p in plans for i in p.rows_B.tolist())
    nonempty = [i for i, n in enumerate(rows.lengths_N.tolist()) if n > 0]
    assert seen == Counter(nonempty)
    for plan in plans:
        assert plan.tokens <= budget
        assert plan.length == int(rows.lengths_N[plan.rows_B].max())
        tenant_B = rows.tenant_N[plan.rows_B].tolist()
        assert plan.offsets[0] == 0 and plan.offsets[-1] == len(tenant_B)
        for lane, tenant in enumerate(plan.lanes):
            a, b = plan.offsets[lane], plan.offsets[lane + 1]
            assert a < b and tenant_B[a:b] == [tenant] * (b - a)
            assert plan.lane_B[a:b].tolist() == [lane] * (b - a)
        assert len(set(plan.lanes)) == len(plan.lanes)  # one slice per tenant


@pytest.mark.parametrize("budget", [64, 200, 600, 4096])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_groups_rows_share_one_microbatch_when_they_fit(budget: int, seed: int) -> None:
    rows = _rows(_batches(6, seed))
    plans = plan_microbatches(rows, budget)
    _check_plan(rows, plans, budget)
    where = {i: k for k, p in enumerate(plans) for i in p.rows_B.tolist()}
    for prompt in rows.prompt_N.unique().tolist():
        members = [i for i in (rows.prompt_N == prompt).nonzero().flatten().tolist()]
        if len(members) * int(rows.lengths_N[members].max()) <= budget:
            assert len({where[i] for i in members}) == 1, (prompt, budget)
        else:  # cut into pieces of its rows, longest first, each within the budget
            assert len({where[i] for i in members}) > 1


def test_groups_of_a_microbatch_pad_their_suffixes_at_most_a_quarter() -> None:
    """But for at most `SMALL_PADDING` tokens of groups of short suffixes."""
    rows = _rows(_batches(8, 3))
    plans = plan_microbatches(rows, 10_000)
    assert len(plans) > 1
    for plan in plans:
        suffix_B = rows.lengths_N[plan.rows_B] - (rows.prompt_len_N[plan.rows_B] - 1)
        longest: dict[int, tuple[int, int]] = {}
        for prompt, s in zip(rows.prompt_N[plan.rows_B].tolist(), suffix_B.tolist(), strict=True):
            n, most = longest.get(prompt, (0, 0))
            longest[prompt] = (n + 1, max(most, s))
        widest = max(most for _, most in longest.values())
        least = math.ceil(MIN_FILL * widest)
        extra = sum(n * (widest - most) for n, most in longest.values() if most < least)
        assert extra <= SMALL_PADDING


@pytest.mark.parametrize("min_fill", [0.25, 0.0])
def test_a_lower_fill_merges_microbatches(min_fill: float) -> None:
    """Under the packed forward's fill (`PACKED_MIN_FILL`) groups of different suffix
    lengths share micro-batches: fewer than at `MIN_FILL`, each still within the budget
    and a valid plan."""
    rows = _rows(_batches(8, 3))
    plans = plan_microbatches(rows, 10_000, min_fill)
    _check_plan(rows, plans, 10_000)
    assert len(plans) < len(plan_microbatches(rows, 10_000))
    assert len(plans) == 1  # 8 tenants' suffixes of 1-17 tokens: within a quarter


def test_the_trainer_shares_prompts_of_many_tenants_within_the_budget(
    lora_model: LoRAModel,
) -> None:
    """The trainer bench's shape (many tenants, one group of 4 each): the planner keeps
    each group whole, so every micro-batch runs its prompts once, and the adapters are
    those of each tenant trained alone."""
    names = list(TENANTS)
    algo = GRPOSpec(group_size=4, prompts_per_step=1)
    data = [
        make_batch(n, 0, algo, seed=50 + i, prompt_len=(16, 20), completion_len=(6, 12))
        for i, n in enumerate(names)
    ]
    rows = tensorise(data, [("token", None)] * len(data))
    plans = plan_microbatches(rows, 4096)
    assert len(plans) == 1 and all(SharedPrefix.plan(rows, m) is not None for m in plans)
    together = GRPOTrainer(lora_model, max_tokens_per_microbatch=4096)
    for i, name in enumerate(names):
        _register(together, name, seed=i)
    together.step(data)
    assert together.stats.shared_prefix_microbatches == 1
    for i, (name, batch) in enumerate(zip(names, data, strict=True)):
        alone = GRPOTrainer(lora_model, max_tokens_per_microbatch=4096)
        _register(alone, name, seed=i)
        alone.step([batch])
        assert _rel_diff(together.adapter(name), alone.adapter(name)) < 1e-5, name


def test_pack_prefix_groups_bounds_the_budget_and_the_suffix_padding() -> None:
    groups = [
        PrefixGroup(10, (8, 7)),
        PrefixGroup(2, (20, 16, 15)),
        PrefixGroup(4, (16,)),
        PrefixGroup(30, (6, 6, 6, 6)),
        PrefixGroup(1, (5, 2)),
    ]
    # By longest suffix: 20, 16 (>= 15, 3/4 of 20); 8, 6 (>= 6); 5.
    assert pack_prefix_groups(groups, 4096) == [[1, 2], [0, 3], [4]]
    # 4 rows x 22 fit in 150; 6 rows x 36 (groups 0 and 3, or 3 and 4) do not.
    batches = pack_prefix_groups(groups, 150)
    assert batches == [[1, 2], [0], [3], [4]]
    for batch in batches:
        rows = sum(len(groups[g].suffixes) for g in batch)
        assert rows * max(groups[g].longest for g in batch) <= 150
    # Group 4, below the MIN_FILL of group 0, pads its 2 rows by 8 - 5 tokens each.
    assert pack_prefix_groups(groups, 4096, allowance=5) == [[1, 2], [0, 3], [4]]
    assert pack_prefix_groups(groups, 4096, allowance=6) == [[1, 2], [0, 3, 4]]
    with pytest.raises(ValueError, match="exceeds the budget of 100"):
        pack_prefix_groups(groups, 100)
    assert pack_prefix_groups([], 100) == []


def test_rows_that_share_no_prompt_are_packed_longest_first() -> None:
    """Without groups (group size 1) the rows are packed as they always were: longest
    first, none shorter than MIN_FILL of its micro-batch; with groups, such rows join
    the groups' micro-batches (a cross-entropy tenant beside a GRPO one)."""
    singles = _batches(3, 7, group_size=1, prompts=5)
    rows = _rows(singles)
    assert torch.equal(rows.prompt_N, torch.arange(15))
    plans = plan_microbatches(rows, 4096)
    _check_plan(rows, plans, 4096)
    order = sorted(range(15), key=lambda i: -int(rows.lengths_N[i]))
    assert [i for p in plans for i in sorted(p.rows_B.tolist(), key=order.index)] == order
    for plan in plans:
        assert int(rows.lengths_N[plan.rows_B].min()) >= MIN_FILL * plan.length
        assert SharedPrefix.plan(rows, plan) is None
    rows = _rows([*_batches(2, 8), *singles])
    plans = plan_microbatches(rows, 4096)
    _check_plan(rows, plans, 4096)
    grouped = set(range(24))  # the rows of the two grouped tenants
    assert any(grouped & set(p.rows_B.tolist()) and set(p.rows_B.tolist()) - grouped for p in plans)


@pytest.mark.parametrize("whole", [(False, False, False), (False, True, False)])
def test_rows_made_per_input_concatenate_to_the_passs_rows(whole: tuple[bool, ...]) -> None:
    """Each `TrainInput` tensorises its own data where it is made (the host's work);
    the pass concatenates them (`concat_rows`): exactly the rows `tensorise_data` makes
    of all the inputs' data at once, tenants of different lengths, prompts numbered
    across them, whole rows where log-probs are wanted."""
    data = [batch_data(b, "token") for b in _batches(3, seed=4)]
    parts = [tensorise_data([d], [w]) for d, w in zip(data, whole, strict=True)]
    assert len({int(p.input_ids_NT.shape[1]) for p in parts}) > 1  # lengths differ
    joined, want = concat_rows(parts), tensorise_data(data, list(whole))
    for name in Rows.__dataclass_fields__:
        assert torch.equal(getattr(joined, name), getattr(want, name)), name


def test_tensorise_data_cuts_rows_after_their_last_weighted_position() -> None:
    """Each row runs up to its last weighted position (all of it where whole) and
    shares the tokens before its first one with its tenant's rows of the same start;
    the fields are the data's, zero-padded: checked against a plain reading of the
    data, on weights with zeros first, inside, last, everywhere, and a whole row."""
    weights = [
        (0.0, 0.0, 0.5, 0.5, 0.0),  # prompt zeros, a trailing zero
        (0.0, 0.0, 1.0, 0.0, 2.0),  # a zero between weighted positions
        (0.0, 0.0, 0.0),  # nothing weighted
        (1.0, 0.0),  # weighted from the first position
        (0.0, 0.0, 0.25, 0.0),  # the same start as row 0's
        (0.0, 3.0, 0.0, 0.0),  # whole: every position runs
    ]
    data = [
        Datum(
            input_ids=tuple(range(7, 7 + len(w))) if i != 1 else (5, 6, 1, 2, 3),
            target_ids=tuple(range(100 + i, 100 + i + len(w))),
            weights_T=w,
            sampling_logprobs_T=tuple(-0.1 * t - 1e-9 * i for t in range(len(w))),
            advantages_T=(0.3 + i,) * len(w) if i % 2 else (),
        )
        for i, w in enumerate(weights)
    ]
    rows = tensorise_data([data[:5], data[5:]], [False, True])
    T = max(len(w) for w in weights)

    def grid(values: list[tuple[float, ...]], dtype: torch.dtype) -> Tensor:
        return torch.tensor([[*v, *(0,) * (T - len(v))] for v in values], dtype=dtype)

    assert torch.equal(rows.input_ids_NT, grid([d.input_ids for d in data], torch.long))
    assert torch.equal(rows.target_ids_NT, grid([d.target_ids for d in data], torch.long))
    assert torch.equal(rows.weights_NT, grid(weights, torch.float32))
    assert torch.equal(rows.mask_NT, grid(weights, torch.float32) != 0)
    assert torch.equal(
        rows.behaviour_NT, grid([d.sampling_logprobs_T for d in data], torch.float32)
    )
    advantages = [d.advantages_T or (0.0,) * len(d.input_ids) for d in data]
    assert torch.equal(rows.advantages_NT, grid(advantages, torch.float32))
    assert rows.lengths_N.tolist() == [4, 5, 0, 1, 3, 4]
    assert rows.tenant_N.tolist() == [0, 0, 0, 0, 0, 1]
    # Rows 0 and 4 share their first two tokens; row 1 starts otherwise (its own
    # prefix: row 1's tokens differ), rows 2 and 3 and the whole row share nothing.
    assert rows.prompt_len_N.tolist() == [3, 3, 4, 1, 3, 1]
    prompts = rows.prompt_N.tolist()
    assert prompts[0] == prompts[4] and len(set(prompts)) == 5


@pytest.mark.parametrize("dtype", [torch.long, torch.float32, torch.float64, torch.bool])
def test_flat_tensor_is_torch_tensor(dtype: torch.dtype) -> None:
    """`flat_tensor` (through an `array` for int64 and float32) makes what `torch.tensor`
    makes of the same list, or refuses what it refuses: float32 rounding and overflow,
    floats for int64 (truncated), ints past int64's range, an empty list."""
    gen = torch.Generator().manual_seed(0)
    doubles = (torch.randn(1000, generator=gen, dtype=torch.float64) * 1e3).tolist()
    doubles += [1 + 2**-24, 1 + 3 * 2**-24, 1e39, -1e-46, 0.0, -0.0, math.inf, math.nan]
    ints = [round(x) for x in doubles[:1000]] + [2**63 - 1, -(2**63), True]
    cases = [doubles, ints, [0.5, *ints], [*ints, 2**63], []]
    for given in cases:
        try:
            want = torch.tensor(given, dtype=dtype)
        except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
            with pytest.raises(type(exc)):
                flat_tensor(given, dtype)
            continue
        got = flat_tensor(given, dtype)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # nan, -0.0 too
