"""Tinker's losses (importance_sampling, ppo, cispo, dro): each loss's gradient is the
one its equation gives, masked positions carry nothing (even with -inf log-probs),
the loss is a weighted sum that splits over rows, and the multi-lane trainer runs
them next to other objectives in one pass."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import Tensor

from marlaas.config.specs import LoRASpec
from marlaas.errors import ConfigError
from marlaas.model.lora import LoRAModel
from marlaas.train.objectives import (
    CISPO,
    DRO,
    PPO,
    CrossEntropy,
    ImportanceSampling,
    LossInputs,
    Objective,
    make_objective,
)
from marlaas.train.optim import AdamParams
from marlaas.train.records import TrainInput
from marlaas.train.trainer import MultiLaneTrainer
from marlaas.types import Datum

TINKER = (ImportanceSampling(), PPO(), CISPO(), DRO(beta=0.3))


def _inputs(seed: int = 0, rows: int = 3, positions: int = 7) -> tuple[LossInputs, Tensor]:
    """Random inputs and the leaf `p` they were made from (its `.grad` after backward)."""
    g = torch.Generator().manual_seed(seed)
    p_BT = (-torch.rand(rows, positions, generator=g) * 3).requires_grad_()
    q_BT = p_BT.detach() + torch.randn(rows, positions, generator=g) * 0.4
    weights_BT = torch.rand(rows, positions, generator=g) + 0.5
    weights_BT[:, :2] = 0.0  # prompt positions
    x = LossInputs(
        logprobs_BT=p_BT,
        logits_NV=torch.zeros(int((weights_BT != 0).sum()), 5),
        weights_BT=weights_BT,
        sampling_logprobs_BT=q_BT,
        advantages_BT=torch.randn(rows, positions, generator=g),
    )
    return x, p_BT


def _grad(objective: Objective, x: LossInputs, p_BT: Tensor) -> Tensor:
    loss, _ = objective(x)
    (grad,) = torch.autograd.grad(loss, p_BT)
    return grad


def test_each_gradient_is_the_one_its_equation_gives() -> None:
    x, p = _inputs()
    w, a = x.weights_BT, x.advantages_BT
    r = torch.exp(p.detach() - x.sampling_logprobs_BT)
    # d/dp of -w r A is -w r A (r = exp(p - q)).
    torch.testing.assert_close(_grad(ImportanceSampling(), x, p), -w * r * a)
    # CISPO: the clipped ratio is a constant, so d/dp of -w c A p is -w c A, clipped or not.
    c = r.clamp(0.8, 1.2)
    torch.testing.assert_close(_grad(CISPO(), x, p), -w * c * a)
    # PPO: the unclipped branch where it is the smaller objective, else no gradient.
    unclipped = (r * a) <= (c * a)
    torch.testing.assert_close(_grad(PPO(), x, p), torch.where(unclipped, -w * r * a, 0.0))
    # DRO: d/dp of -w (A p - beta/2 (p - q)^2) is -w (A - beta (p - q)).
    q = x.sampling_logprobs_BT
    torch.testing.assert_close(_grad(DRO(beta=0.3), x, p), -w * (a - 0.3 * (p.detach() - q)))


def test_ppo_equals_importance_sampling_inside_the_clip_range() -> None:
    x, _ = _inputs()
    near = LossInputs(
        logprobs_BT=x.logprobs_BT,
        logits_NV=x.logits_NV,
        weights_BT=x.weights_BT,
        sampling_logprobs_BT=x.logprobs_BT.detach() + 0.01,  # r within [0.8, 1.2]
        advantages_BT=x.advantages_BT,
    )
    ppo_loss, ppo_sums = PPO()(near)
    is_loss, _ = ImportanceSampling()(near)
    assert float(ppo_loss.detach()) == pytest.approx(float(is_loss.detach()), rel=1e-6)
    assert int(ppo_sums["clipped"]) == 0
    _, wide = PPO(clip_low_threshold=0.0, clip_high_threshold=1e9)(x)
    assert int(wide["clipped"]) == 0
    _, tight = PPO(clip_low_threshold=1.0, clip_high_threshold=1.0)(x)
    assert int(tight["clipped"]) > 0


@pytest.mark.parametrize("objective", TINKER, ids=lambda o: o.name)
def test_masked_positions_carry_nothing_even_at_minus_infinity(objective: Objective) -> None:
    x, p = _inputs(seed=1)
    masked = x.weights_BT == 0
    logprobs = torch.where(masked, float("-inf"), p)
    sampling = torch.where(masked, float("-inf"), x.sampling_logprobs_BT)
    y = LossInputs(logprobs, x.logits_NV, x.weights_BT, sampling, x.advantages_BT)
    loss, sums = objective(y)
    (grad,) = torch.autograd.grad(loss, p)
    assert math.isfinite(float(loss.detach()))
    assert torch.all(grad[masked] == 0)
    assert int(sums["tokens"]) == int((~masked).sum())
    assert math.isfinite(float(sums["ratio"]))


@pytest.mark.parametrize("objective", TINKER, ids=lambda o: o.name)
def test_the_loss_is_a_weighted_sum_that_splits_over_rows(objective: Objective) -> None:
    x, _ = _inputs(seed=2, rows=4)
    whole, whole_sums = objective(x)

    def rows(sl: slice, scale: float = 1.0) -> LossInputs:
        part = x.rows(sl.start, sl.stop)
        return dataclasses.replace(part, weights_BT=part.weights_BT * scale)

    first, first_sums = objective(rows(slice(0, 1)))
    rest, rest_sums = objective(rows(slice(1, 4)))
    assert float((first + rest).detach()) == pytest.approx(
        float(whole.detach()), rel=1e-5, abs=1e-6
    )
    for key in whole_sums:
        assert float(first_sums[key] + rest_sums[key]) == pytest.approx(
            float(whole_sums[key]), rel=1e-5, abs=1e-6
        ), key
    doubled, _ = objective(rows(slice(0, 4), scale=2.0))
    assert float(doubled.detach()) == pytest.approx(2 * float(whole.detach()), rel=1e-5)


def test_the_registry_builds_them_from_tinker_configs_and_names_what_is_wrong() -> None:
    assert make_objective("ppo", {"clip_low_threshold": 0.9}) == PPO(clip_low_threshold=0.9)
    assert make_objective("cispo", {"clip_high_threshold": 2.0}) == CISPO(clip_high_threshold=2.0)
    assert make_objective("dro", {"beta": 0.1}) == DRO(beta=0.1)
    assert make_objective("importance_sampling") == ImportanceSampling()
    with pytest.raises(ConfigError, match="0 <= clip_low_threshold <= 1 <= clip_high_threshold"):
        make_objective("ppo", {"clip_low_threshold": 0.2, "clip_high_threshold": 0.2})
    with pytest.raises(ConfigError, match="beta >= 0"):
        make_objective("dro", {"beta": -1.0})
    with pytest.raises(ConfigError, match="its options: none"):
        make_objective("importance_sampling", {"beta": 0.1})


def _rl_data(seed: int) -> tuple[Datum, ...]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (9, 12):
        ids = torch.randint(4, 128, (n + 1,), generator=g).tolist()
        w = [0.0] * 3 + [1.0] * (n - 3)
        q = (-torch.rand(n, generator=g) * 4).tolist()
        a = (torch.randn(1, generator=g).item(),) * n
        out.append(Datum(tuple(ids[:-1]), tuple(ids[1:]), tuple(w), tuple(q), a))
    return tuple(out)


def _pad(values: tuple[float, ...], width: int) -> list[float]:
    return [*values, *([0.0] * (width - len(values)))]


def test_the_trainer_runs_each_in_one_pass_with_its_own_log_probs(lora_model: LoRAModel) -> None:
    """Five tenants, five objectives, one pass; each loss is its equation over the
    trainer's own log-probs of the tenant's data."""
    trainer = MultiLaneTrainer(lora_model)
    lora = LoRASpec(rank=4, target_modules=("q_proj", "v_proj"))
    objectives: list[Objective] = [*TINKER, CrossEntropy()]
    inputs = []
    for i, objective in enumerate(objectives):
        trainer.add(objective.name, lora, seed=i)
        inputs.append(TrainInput(objective.name, _rl_data(i), objective))
    logprobs = trainer.forward(
        [TrainInput(t.tenant, t.data, CrossEntropy(), return_logprobs=True) for t in inputs]
    )
    out = trainer.forward_backward(inputs)
    assert trainer.stats.max_microbatch_lanes == len(objectives)
    for inp in inputs:
        rows = logprobs[inp.tenant].logprobs
        assert rows is not None
        width = max(len(d.input_ids) for d in inp.data)
        p = torch.tensor([_pad(r, width) for r in rows]).requires_grad_()
        weights = torch.tensor([_pad(d.weights_T, width) for d in inp.data])
        x = LossInputs(
            logprobs_BT=p,
            logits_NV=torch.zeros(int((weights != 0).sum()), 2),
            weights_BT=weights,
            sampling_logprobs_BT=torch.tensor(
                [_pad(d.sampling_logprobs_T, width) for d in inp.data]
            ),
            advantages_BT=torch.tensor([_pad(d.advantages_T, width) for d in inp.data]),
        )
        expected, _ = inp.loss(x)
        assert out[inp.tenant].loss == pytest.approx(float(expected.detach()), rel=1e-4, abs=1e-5)
    steps = trainer.optim_step([(o.name, AdamParams(lr=1e-2)) for o in objectives])
    assert all(s.grad_norm > 0 for s in steps.values())
