"""The training path of `LanePlan`: `BlockLoRA`'s hand-written backward gives the
gradients autograd gives for the plain ops, for every block layout a trainer's
micro-batch can take."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from marlaas.model.lane_plan import BlockLoRA, LanePlan


def _plain(
    x_BTi: Tensor, A_Lri: Tensor, B_Lor: Tensor, y_BTo: Tensor, lane_B: Tensor, scale_L: Tensor
) -> Tensor:
    """The LoRA update by its definition, row by row, through autograd."""
    out = []
    for b, lane in enumerate(lane_B.tolist()):
        h_Tr = x_BTi[b] @ A_Lri[lane].T * scale_L[lane]
        out.append(y_BTo[b] + h_Tr @ B_Lor[lane].T)
    return torch.stack(out)


@pytest.mark.parametrize(
    ("lanes", "num_lanes"),
    [
        ([0, 0, 1, 2, 2, 2, 3], 4),  # unequal runs: one block per row, weights gathered
        ([0, 0, 1, 1, 2, 2], 3),  # equal runs in lane order: blocks of 2, no gather
        ([1, 1, 0, 0], 3),  # equal runs out of order, a lane without rows
        ([2], 3),
    ],
)
@pytest.mark.parametrize("x_grad", [True, False])
def test_block_lora_matches_autograd(lanes: list[int], num_lanes: int, x_grad: bool) -> None:
    g = torch.Generator().manual_seed(len(lanes) * 7 + num_lanes)
    B, T, fan_in, fan_out, r = len(lanes), 5, 12, 9, 3
    lane_B = torch.tensor(lanes)
    scale_L = torch.rand(num_lanes, generator=g) + 0.5
    x = torch.randn(B, T, fan_in, generator=g)
    A = torch.randn(num_lanes, r, fan_in, generator=g)
    Bw = torch.randn(num_lanes, fan_out, r, generator=g)
    y = torch.randn(B, T, fan_out, generator=g)
    grad_out = torch.randn(B, T, fan_out, generator=g)

    def run(fast: bool) -> list[Tensor]:
        leaves = [t.clone().requires_grad_(True) for t in (x, A, Bw, y)]
        xl, Al, Bl, yl = leaves
        if not x_grad:
            xl.requires_grad_(False)
        if fast:
            plan = LanePlan.of(lane_B, num_lanes, scale_L, scale_L[lane_B], T, r)
            assert plan.segments is None
            out = plan.apply(xl, Al, Bl, yl)
            node = out.grad_fn
            assert node is not None
            if type(node).__name__ == "ViewBackward0":  # blocks of several rows
                node = node.next_functions[0][0]
            assert "BlockLoRA" in type(node).__name__
        else:
            out = _plain(xl, Al, Bl, yl, lane_B, scale_L)
        out.backward(grad_out)
        grads = [t.grad for t in leaves]
        return [out.detach()] + [
            torch.zeros_like(t) if grad is None else grad
            for t, grad in zip(leaves, grads, strict=True)
        ]

    for fast, plain in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)


def test_block_lora_without_scales_and_no_grad_path_unchanged() -> None:
    """Prescaled weights (no scales) take the same backward; under `no_grad` (decode)
    the plan runs the plain ops, no custom node."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 2, 6, generator=g)
    A = torch.randn(2, 2, 6, generator=g, requires_grad=True)
    Bw = torch.randn(2, 5, 2, generator=g, requires_grad=True)
    y = torch.randn(4, 2, 5, generator=g)
    lane_K = torch.tensor([1, 0])
    out = BlockLoRA.apply(x.reshape(2, 4, 6), A, Bw, y.reshape(2, 4, 5), lane_K, None)
    out.sum().backward()
    A2 = A.detach().clone().requires_grad_(True)
    B2 = Bw.detach().clone().requires_grad_(True)
    ref = y.reshape(2, 4, 5) + torch.bmm(
        torch.bmm(x.reshape(2, 4, 6), A2[lane_K].transpose(1, 2)), B2[lane_K].transpose(1, 2)
    )
    ref.sum().backward()
    torch.testing.assert_close(out.detach(), ref.detach())
    torch.testing.assert_close(A.grad, A2.grad)
    torch.testing.assert_close(Bw.grad, B2.grad)
    plan = LanePlan.of(torch.tensor([1, 1, 0, 0]), 2, None, torch.ones(4), 2, 2)
    with torch.no_grad():
        plain = plan.apply(x, A, Bw, y)
    assert plain.grad_fn is None
    torch.testing.assert_close(plain, ref.detach().reshape(4, 2, 5))
