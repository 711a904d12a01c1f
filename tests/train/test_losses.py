"""Losses and advantages: hand-computed cases, masking, and the micro-batch invariant."""

from __future__ import annotations

import itertools
import math
from typing import TypedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from marlaas.errors import ConfigError
from marlaas.model import kernels
from marlaas.train import (
    LossNorm,
    entropy_from_logits,
    group_advantages,
    kl_penalty,
    policy_loss,
    token_logprobs,
    token_weights,
)

F64 = torch.float64


class Clip(TypedDict):
    clip_low: float
    clip_high: float


CLIP: Clip = {"clip_low": 0.2, "clip_high": 0.28}


def t(values: object) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


# --- group_advantages -------------------------------------------------------------------


def test_advantages_without_std_are_centred_rewards() -> None:
    adv = group_advantages(t([1.0, 0.0, 0.0, 1.0, 1.0]), scale=False)
    torch.testing.assert_close(adv, t([0.4, -0.6, -0.6, 0.4, 0.4]))


def test_advantages_with_std_use_the_unbiased_group_std() -> None:
    # [1, 0]: mean 0.5, unbiased std sqrt(0.5); [3, 1]: mean 2, std sqrt(2). Scaling makes
    # both groups the same (population std would give +-1 instead of +-sqrt(0.5)).
    adv = group_advantages(t([[1.0, 0.0], [3.0, 1.0]]), scale=True, eps=0.0)
    s = math.sqrt(0.5)
    torch.testing.assert_close(adv, t([[s, -s], [s, -s]]))
    scaled = group_advantages(t([2.0, 0.0, 1.0]), scale=True, eps=1e-6)
    torch.testing.assert_close(scaled, t([1.0, -1.0, 0.0]) / (1.0 + 1e-6))


@pytest.mark.parametrize("scale", [True, False])
def test_identical_rewards_give_exact_zero_advantages(scale: bool) -> None:
    # 0.1 has no exact binary form, so r - mean(r) is not exactly 0 here; it must still
    # come out exactly 0, not a rounding error divided by eps.
    rewards = t([[0.1] * 7, [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0]])
    adv = group_advantages(rewards, scale=scale)
    assert torch.equal(adv[0], torch.zeros(7, dtype=F64))
    assert adv[1].abs().min() > 0.1
    assert torch.equal(group_advantages(rewards, scale=scale, eps=0.0)[0], adv[0])
    single = group_advantages(t([[3.0]]), scale=scale)
    assert torch.equal(single, torch.zeros(1, 1, dtype=F64))


def test_integer_rewards_and_bad_shapes() -> None:
    adv = group_advantages(torch.tensor([1, 0]), scale=False)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5]))
    with pytest.raises(ConfigError):
        group_advantages(torch.zeros(2, 2, 2), scale=True)


# --- token_weights and normalisation ------------------------------------------------------

RAGGED = t([[1, 1, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]])  # 3 + 1 valid tokens, one empty row


def test_token_weights_each_mode_on_a_ragged_mask() -> None:
    torch.testing.assert_close(token_weights(RAGGED, "token"), RAGGED.float() / 4)
    expected_seq = torch.tensor([[1 / 6, 1 / 6, 1 / 6, 0], [0, 1 / 2, 0, 0], [0, 0, 0, 0]])
    torch.testing.assert_close(token_weights(RAGGED, "sequence"), expected_seq)
    const = token_weights(RAGGED, "constant", constant_norm_tokens=8)
    torch.testing.assert_close(const, RAGGED.float() / 8)
    assert torch.equal(token_weights(torch.zeros(2, 3), "token"), torch.zeros(2, 3))
    assert torch.equal(token_weights(torch.zeros(2, 3), "sequence"), torch.zeros(2, 3))
    with pytest.raises(ConfigError):
        token_weights(RAGGED, "constant")
    with pytest.raises(ConfigError):
        token_weights(RAGGED, "mean")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("loss_norm", "expected"),
    # A = [1, -2, 5]: token -(3*1 - 2)/4; sequence -(1 - 2)/2; constant -(3 - 2)/8
    [("token", -0.25), ("sequence", 0.5), ("constant", -0.125)],
)
def test_ratio_one_gives_minus_the_normalised_mean_advantage(
    loss_norm: LossNorm, expected: float
) -> None:
    lp = torch.full((3, 4), -1.3, dtype=F64, requires_grad=True)
    loss, m = policy_loss(
        lp, lp.detach(), t([1.0, -2.0, 5.0]), RAGGED, **CLIP,
        loss_norm=loss_norm, constant_norm_tokens=8 if loss_norm == "constant" else None,
    )  # fmt: skip
    torch.testing.assert_close(loss, t(expected))
    assert m["clip_frac"] == 0 and m["ratio_mean"] == 1 and m["kl_behaviour"] == 0
    assert m["tokens"] == 4
    (grad,) = torch.autograd.grad(loss, lp)
    # d loss / d logprob = -w * A * r with r = 1
    w = token_weights(RAGGED, loss_norm, constant_norm_tokens=8).to(F64)
    torch.testing.assert_close(grad, -w * t([1.0, -2.0, 5.0])[:, None])


# --- clipping -------------------------------------------------------------------------------


def test_clipping_on_both_sides() -> None:
    # One row per token so each has its own advantage; clip range [0.8, 1.28].
    ratios = t([1.5, 0.5, 0.5, 1.5, 1.25, 0.9])
    adv = t([1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
    # clipped: (A>0, r>1.28) and (A<0, r<0.8); the others keep the unclipped branch
    expected_tok = t([-1.28, 0.8, -0.5, 1.5, -1.25, 0.9])
    behaviour = torch.zeros(6, 1, dtype=F64)
    lp = torch.log(ratios)[:, None].clone().requires_grad_(True)
    mask = torch.ones(6, 1)
    loss, m = policy_loss(lp, behaviour, adv, mask, **CLIP)
    torch.testing.assert_close(loss, expected_tok.mean())
    (grad,) = torch.autograd.grad(loss, lp)
    expected_grad = -(ratios * adv) / 6
    expected_grad[:2] = 0.0
    torch.testing.assert_close(grad[:, 0], expected_grad)
    assert m["clip_frac"].item() == pytest.approx(2 / 6)
    assert m["clip_frac_low"].item() == pytest.approx(1 / 6)
    assert m["clip_frac_high"].item() == pytest.approx(1 / 6)
    assert m["ratio_min"].item() == pytest.approx(0.5)
    assert m["ratio_max"].item() == pytest.approx(1.5)
    assert m["ratio_mean"].item() == pytest.approx(ratios.mean().item())
    k3 = ((ratios - 1) - torch.log(ratios)).mean()
    assert m["kl_behaviour"].item() == pytest.approx(k3.item())


def test_zero_clip_low_still_passes_gradient_inside_the_range() -> None:
    lp = torch.log(t([[1.1]])).requires_grad_(True)
    loss, m = policy_loss(lp, t([[0.0]]), t([-1.0]), torch.ones(1, 1), clip_low=0.0, clip_high=0.2)
    (grad,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(grad, t([[1.1]]))  # A < 0, r > 1: unclipped
    assert m["clip_frac"] == 0


# --- truncated importance sampling ----------------------------------------------------------


def test_tis_caps_the_importance_weight_of_unclipped_tokens() -> None:
    # r = [3, 1.5, 0.5], A = [-1, -1, 1], cap 2: row 0 is capped (weight 2 instead of 3),
    # row 1 is under the cap, row 2 is under the cap.
    ratios = t([3.0, 1.5, 0.5])
    adv = t([-1.0, -1.0, 1.0])
    mask = torch.ones(3, 1)
    lp = torch.log(ratios)[:, None].clone().requires_grad_(True)
    loss, m = policy_loss(lp, torch.zeros(3, 1, dtype=F64), adv, mask, **CLIP, tis_cap=2.0)
    torch.testing.assert_close(loss, t([2.0, 1.5, -0.5]).mean())
    (grad,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(grad[:, 0], t([2.0, 1.5, -0.5]) / 3)
    assert m["tis_frac"].item() == pytest.approx(1 / 3)

    loss_off, m_off = policy_loss(lp, torch.zeros(3, 1, dtype=F64), adv, mask, **CLIP)
    torch.testing.assert_close(loss_off, t([3.0, 1.5, -0.5]).mean())
    assert m_off["tis_frac"] == 0


def test_tis_leaves_clipped_tokens_without_gradient() -> None:
    lp = torch.log(t([[3.0]])).requires_grad_(True)  # A > 0, r > 1.28: clipped
    loss, _ = policy_loss(lp, t([[0.0]]), t([1.0]), torch.ones(1, 1), **CLIP, tis_cap=2.0)
    (grad,) = torch.autograd.grad(loss, lp)
    assert grad.item() == 0.0
    torch.testing.assert_close(loss, t(-1.28 * 2 / 3))


# --- masking ----------------------------------------------------------------------------------


def test_masked_tokens_carry_exactly_zero_gradient_even_when_not_finite() -> None:
    mask = t([[0, 1, 1, 0], [1, 1, 0, 0]])  # prompt / tool output / padding are 0
    lp = t([[-50.0, -1.0, -2.0, float("-inf")], [-0.5, -0.7, 80.0, float("nan")]])
    lp.requires_grad_(True)
    behaviour = t([[0.0, -1.1, -1.9, 0.0], [-0.6, -0.7, -90.0, 0.0]])
    loss, m = policy_loss(lp, behaviour, t([1.0, -1.0]), mask, **CLIP, tis_cap=1.5)
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.isfinite(loss)
    assert torch.all(grad[mask == 0] == 0)
    assert torch.all(grad[mask == 1] != 0)
    assert m["tokens"] == 4 and torch.isfinite(m["ratio_max"])
    kl = kl_penalty(lp, behaviour, "k3", mask_BT=mask)
    (kl_grad,) = torch.autograd.grad(kl.sum(), lp)
    assert torch.all(kl[mask == 0] == 0) and torch.all(kl_grad[mask == 0] == 0)


def test_metrics_count_valid_tokens_only() -> None:
    lp = torch.log(t([[2.0, 3.0, 0.01, 5.0]]))
    mask = t([[1, 1, 0, 0]])
    _, m = policy_loss(lp, torch.zeros(1, 4, dtype=F64), t([1.0]), mask, **CLIP, tis_cap=2.5)
    assert m["tokens"] == 2
    assert m["clip_frac"] == 1.0 and m["clip_frac_high"] == 1.0 and m["clip_frac_low"] == 0
    assert m["ratio_min"].item() == pytest.approx(2.0)
    assert m["ratio_max"].item() == pytest.approx(3.0)
    assert m["ratio_mean"].item() == pytest.approx(2.5)
    assert m["tis_frac"].item() == pytest.approx(0.5)
    k3 = (1.0 - math.log(2.0) + 2.0 - math.log(3.0)) / 2
    assert m["kl_behaviour"].item() == pytest.approx(k3)
    # all valid ratios below 1, cap below 1: the masked positions must not count either
    lp_low = torch.log(t([[0.5, 0.25, 0.01, 1.0]]))
    _, m = policy_loss(lp_low, torch.zeros(1, 4, dtype=F64), t([1.0]), mask, **CLIP, tis_cap=0.4)
    assert m["ratio_max"].item() == pytest.approx(0.5)
    assert m["tis_frac"].item() == pytest.approx(0.5)


def test_caller_weights_on_masked_tokens_are_ignored() -> None:
    lp = torch.full((1, 3), -1.0, dtype=F64, requires_grad=True)
    mask = t([[0, 1, 1]])
    loss, _ = policy_loss(lp, lp.detach(), t([2.0]), mask, **CLIP, weights_BT=torch.ones(1, 3))
    (grad,) = torch.autograd.grad(loss, lp)
    assert loss.item() == -4.0 and grad[0, 0] == 0


def test_all_masked_batch_gives_zero_loss_and_finite_metrics() -> None:
    lp = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    loss, m = policy_loss(lp, lp.detach(), t([1.0, 2.0]), torch.zeros(2, 3), **CLIP)
    assert loss.item() == 0.0
    assert all(torch.isfinite(v) for v in m.values()) and m["tokens"] == 0


def test_argument_errors() -> None:
    lp = torch.zeros(2, 3)
    mask = torch.ones(2, 3)
    with pytest.raises(ConfigError):
        policy_loss(lp, lp, torch.zeros(3), mask, **CLIP)  # advantages not [B]
    with pytest.raises(ConfigError):
        policy_loss(lp, lp[:, :2], torch.zeros(2), mask, **CLIP)
    with pytest.raises(ConfigError):
        policy_loss(lp, lp, torch.zeros(2), mask, clip_low=1.0, clip_high=0.2)
    with pytest.raises(ConfigError):
        policy_loss(lp, lp, torch.zeros(2), mask, **CLIP, weights_BT=mask, loss_norm="token")
    with pytest.raises(ConfigError):
        kl_penalty(lp, lp, "k2")  # type: ignore[arg-type]


# --- the micro-batch invariant ------------------------------------------------------------

V = 7


def _batch(seed: int, rows: int, tokens: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, tokens + 1, (rows,), generator=g)
    starts = torch.randint(0, 2, (rows,), generator=g)  # a prompt token or not
    pos = torch.arange(tokens)
    mask = ((pos >= starts[:, None]) & (pos < (starts + lengths)[:, None])).to(F64)
    return {
        "base_BTV": torch.randn(rows, tokens, V, generator=g, dtype=F64),
        "targets_BT": torch.randint(0, V, (rows, tokens), generator=g),
        "behaviour_BT": -torch.rand(rows, tokens, generator=g, dtype=F64) * 3,
        "advantages_B": torch.randn(rows, generator=g, dtype=F64),
        "mask_BT": mask,
    }


def _rows_loss(
    theta_V: torch.Tensor, b: dict[str, torch.Tensor], rows: slice, weights_BT: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A tiny policy: the tenant's 'adapter' is a logit bias theta_V on a frozen base."""
    lp = token_logprobs(b["base_BTV"][rows] + theta_V, b["targets_BT"][rows], temperature=0.7)
    return policy_loss(
        lp, b["behaviour_BT"][rows], b["advantages_B"][rows], b["mask_BT"][rows],
        **CLIP, tis_cap=1.5, weights_BT=weights_BT[rows],
    )  # fmt: skip


@pytest.mark.parametrize("loss_norm", ["token", "sequence", "constant"])
def test_micro_batches_sum_to_the_full_batch_loss_and_gradient(loss_norm: LossNorm) -> None:
    b = _batch(0, rows=7, tokens=6)
    w = token_weights(b["mask_BT"], loss_norm, constant_norm_tokens=42)
    theta = torch.linspace(-0.5, 0.5, V, dtype=F64).requires_grad_(True)
    full, _ = _rows_loss(theta, b, slice(0, 7), w)
    (full_grad,) = torch.autograd.grad(full, theta)
    parts = [_rows_loss(theta, b, rows, w)[0] for rows in (slice(0, 2), slice(2, 3), slice(3, 7))]
    split = torch.stack(parts).sum()
    (split_grad,) = torch.autograd.grad(split, theta)
    assert full.abs() > 1e-3 and full_grad.abs().max() > 1e-3  # not trivially zero
    torch.testing.assert_close(split, full, atol=1e-6, rtol=0)
    torch.testing.assert_close(split_grad, full_grad, atol=1e-6, rtol=0)


def test_tenants_mixed_in_micro_batches_match_each_tenant_alone() -> None:
    a, b = _batch(1, rows=4, tokens=5), _batch(2, rows=3, tokens=5)
    w_a = token_weights(a["mask_BT"], "token")
    w_b = token_weights(b["mask_BT"], "sequence")
    theta_a = torch.zeros(V, dtype=F64).requires_grad_(True)
    theta_b = torch.full((V,), 0.3, dtype=F64).requires_grad_(True)
    alone_a, _ = _rows_loss(theta_a, a, slice(0, 4), w_a)
    alone_b, _ = _rows_loss(theta_b, b, slice(0, 3), w_b)
    grads_alone = torch.autograd.grad(alone_a + alone_b, (theta_a, theta_b))

    # Two micro-batches, each holding rows of both tenants with each tenant's weights.
    mixed = torch.zeros((), dtype=F64)
    for rows_a, rows_b in ((slice(0, 1), slice(0, 2)), (slice(1, 4), slice(2, 3))):
        la, _ = _rows_loss(theta_a, a, rows_a, w_a)
        lb, _ = _rows_loss(theta_b, b, rows_b, w_b)
        mixed = mixed + la + lb
    grads_mixed = torch.autograd.grad(mixed, (theta_a, theta_b))
    torch.testing.assert_close(mixed, alone_a + alone_b, atol=1e-6, rtol=0)
    for got, want in zip(grads_mixed, grads_alone, strict=True):
        assert want.abs().max() > 1e-4
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    rows=st.integers(1, 6),
    cuts=st.lists(st.integers(1, 5), max_size=3),
    loss_norm=st.sampled_from(["token", "sequence", "constant"]),
)
def test_any_row_split_preserves_the_loss(
    seed: int, rows: int, cuts: list[int], loss_norm: LossNorm
) -> None:
    b = _batch(seed, rows=rows, tokens=4)
    w = token_weights(b["mask_BT"], loss_norm, constant_norm_tokens=16)
    theta = torch.zeros(V, dtype=F64)
    full, _ = _rows_loss(theta, b, slice(0, rows), w)
    bounds = [0, *sorted({c for c in cuts if c < rows}), rows]
    split = sum(_rows_loss(theta, b, slice(i, j), w)[0] for i, j in itertools.pairwise(bounds))
    assert abs(float(split) - float(full)) < 1e-9


# --- KL, entropy, log-probs -----------------------------------------------------------------


def test_kl_estimators_match_their_formulas() -> None:
    lp = t([[-1.0, -2.0, -0.1]])
    ref = t([[-1.5, -1.0, -0.1]])
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), t([[0.5, -1.0, 0.0]]))
    r = torch.exp(ref - lp)
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), (r - 1) - torch.log(r))
    torch.testing.assert_close(
        kl_penalty(lp, ref, "k3"), t([[math.exp(-0.5) - 0.5, math.e - 2.0, 0.0]])
    )


@given(st.lists(st.floats(-30, 0), min_size=2, max_size=12))
def test_k3_is_never_negative(values: list[float]) -> None:
    lp = t([values])
    ref = torch.flip(lp, dims=[1]) - 0.3
    assert torch.all(kl_penalty(lp, ref, "k3") >= 0)


def test_k3_averages_to_the_exact_kl_under_the_sampling_policy() -> None:
    # E_{x~p}[k3] = KL(p || q) exactly when the expectation is taken over all x.
    p = torch.softmax(t([0.3, -1.0, 2.0, 0.0]), 0)
    q = torch.softmax(t([1.0, 0.5, -0.5, 0.2]), 0)
    k3 = kl_penalty(torch.log(p)[None], torch.log(q)[None], "k3")[0]
    k1 = kl_penalty(torch.log(p)[None], torch.log(q)[None], "k1")[0]
    exact = (p * (torch.log(p) - torch.log(q))).sum()
    torch.testing.assert_close((p * k3).sum(), exact)
    torch.testing.assert_close((p * k1).sum(), exact)


def test_entropy_of_uniform_and_peaked_distributions() -> None:
    logits = torch.zeros(2, 3, 11)
    logits[1, 2] = torch.tensor([1e4] + [0.0] * 10)  # one-hot in float32, no overflow
    h = entropy_from_logits(logits)
    torch.testing.assert_close(h[0], torch.full((3,), math.log(11)))
    assert h[1, 2].abs() < 1e-6
    shifted = entropy_from_logits(torch.zeros(1, 1, 11) + 500.0)
    torch.testing.assert_close(shifted, torch.full((1, 1), math.log(11)))


def test_entropy_matches_the_definition_and_handles_banned_tokens() -> None:
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(3), dtype=F64)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(entropy_from_logits(logits), -(p * p.log()).sum(-1))
    banned = torch.tensor([[[0.0, 0.0, float("-inf"), float("-inf")]]], requires_grad=True)
    h = entropy_from_logits(banned)
    (grad,) = torch.autograd.grad(h.sum(), banned)
    torch.testing.assert_close(h, torch.full((1, 1), math.log(2)))
    assert torch.all(torch.isfinite(grad))


@pytest.mark.parametrize("vocab", [258, 16, 7])
def test_the_native_entropy_equals_the_log_softmax_way(vocab: int) -> None:
    """Without gradient (the metric's), float32 logits take one native pass per row
    (`kernels.entropy_rows`: sixteen at a time, the rest one by one): the definition's
    value up to float rounding, at any scale; a banned token (-inf) leaves it to torch."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, 5, vocab, generator=g) * 4 + 30.0
    want = entropy_from_logits(logits.double()).float()
    got = entropy_from_logits(logits)
    if kernels.native_kernels("entropy_rows"):
        native = kernels.entropy_rows(logits.reshape(-1, vocab))
        assert native is not None
        torch.testing.assert_close(native.view(4, 5), got)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    banned = logits.clone()
    banned[..., 1] = float("-inf")
    assert kernels.entropy_rows(banned.reshape(-1, vocab)) is None
    p = torch.softmax(banned.double(), -1)
    plogp = torch.where(p > 0, p * p.log(), 0.0)
    torch.testing.assert_close(entropy_from_logits(banned), -plogp.sum(-1).float())


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_token_logprobs_match_a_manual_log_softmax(temperature: float) -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 9, generator=g) * 5
    targets = torch.randint(0, 9, (2, 3), generator=g)
    manual = torch.empty(2, 3)
    for i in range(2):
        for j in range(3):
            z = logits[i, j] / temperature
            manual[i, j] = z[targets[i, j]] - torch.log(torch.exp(z - z.max()).sum()) - z.max()
    before = logits.clone()
    got = token_logprobs(logits, targets, temperature)
    torch.testing.assert_close(got, manual)
    assert torch.equal(logits, before)  # the caller's logits are untouched
    half = token_logprobs(logits.to(torch.bfloat16), targets, temperature)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, manual, atol=0.1, rtol=0.02)
    with pytest.raises(ConfigError):
        token_logprobs(logits, targets, temperature=0.0)


def test_token_logprobs_gradient_is_onehot_minus_softmax() -> None:
    logits = torch.randn(1, 1, 4, dtype=F64, requires_grad=True)
    lp = token_logprobs(logits, torch.tensor([[2]]), temperature=2.0)
    (grad,) = torch.autograd.grad(lp.sum(), logits)
    expected = (torch.nn.functional.one_hot(torch.tensor(2), 4) - torch.softmax(logits / 2, -1)) / 2
    torch.testing.assert_close(grad, expected.detach())
