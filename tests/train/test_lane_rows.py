"""Several lanes' policy-gradient rows in one set of ops (`objectives.lane_rows`): the
loss, each lane's sums and the gradient equal each lane's own `PolicyGradient` call, with
the same settings or each lane its own (clip range, TIS cap or none); a lane with a KL
term, or another objective, keeps the per-lane calls."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from marlaas.train.objectives import CrossEntropy, LossInputs, PolicyGradient, lane_rows

#: Rows per lane (lanes' rows are contiguous, as in a micro-batch).
ROWS = (3, 1, 4)


def _inputs(seed: int = 0, positions: int = 6) -> tuple[LossInputs, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    B, V = sum(ROWS), 11
    logits = torch.randn(B, positions, V, generator=g).requires_grad_()
    targets = torch.randint(0, V, (B, positions), generator=g)
    lp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    weights = torch.rand(B, positions, generator=g) * (torch.rand(B, positions, generator=g) > 0.3)
    x = LossInputs(
        logprobs_BT=lp,
        logits_NV=logits.detach()[weights != 0],
        weights_BT=weights,
        sampling_logprobs_BT=lp.detach() + torch.randn(B, positions, generator=g) * 0.5,
        advantages_BT=torch.randn(B, positions, generator=g),
    )
    lane_B = torch.repeat_interleave(torch.arange(len(ROWS)), torch.tensor(ROWS))
    return x, lane_B, logits


@pytest.mark.parametrize(
    "objectives",
    [
        [PolicyGradient()] * 3,
        [PolicyGradient(clip_low=0.1, clip_high=0.28, tis_cap=2.0)] * 3,
        [PolicyGradient(), PolicyGradient(clip_low=0.05, clip_high=0.5, tis_cap=1.2),
         PolicyGradient(clip_high=0.01, tis_cap=None)],
    ],
    ids=["alike", "alike-tis", "each-its-own"],
)  # fmt: skip
def test_one_set_of_ops_equals_each_lanes_call(objectives: list[PolicyGradient]) -> None:
    x, lane_B, logits = _inputs()
    together = lane_rows(objectives, lane_B, x)
    assert together is not None
    loss, row_sums = together
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
    offsets = [0, *torch.tensor(ROWS).cumsum(0).tolist()]
    total = torch.zeros(())
    for lane, objective in enumerate(objectives):
        a, b = offsets[lane], offsets[lane + 1]
        lane_loss, lane_sums = objective(x.rows(a, b))
        total = total + lane_loss
        assert set(row_sums) == set(lane_sums)
        for name, value in lane_sums.items():
            torch.testing.assert_close(
                row_sums[name][a:b].sum().to(torch.float64), value.to(torch.float64),
                rtol=1e-5, atol=1e-6, msg=name,
            )  # fmt: skip
    (want,) = torch.autograd.grad(total, logits)
    torch.testing.assert_close(loss, total, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-7)
    assert row_sums["clipped"].sum() > 0  # the clip ranges are exercised


def test_a_kl_term_or_another_objective_keeps_the_per_lane_calls() -> None:
    x, lane_B, _ = _inputs()
    assert (
        lane_rows([PolicyGradient(), PolicyGradient(kl_coef=0.1), PolicyGradient()], lane_B, x)
        is None
    )
    assert lane_rows([PolicyGradient(), CrossEntropy(), PolicyGradient()], lane_B, x) is None
