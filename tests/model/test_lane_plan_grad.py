"""The training path of `LanePlan`: `BlockLoRA`'s hand-written backward gives the
gradients autograd gives for the plain ops, for every block layout a trainer's
micro-batch can take."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import Tensor

from marlaas.model.lane_plan import LanePlan
from marlaas.model.lora_grad import BlockLoRA, RowsLoRA


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


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("scaled", [True, False])
def test_packed_runs_match_autograd(native: bool, scaled: bool) -> None:
    """A packed micro-batch (a token a row, each lane's tokens one run of its own length,
    lanes out of order, one lane absent): the native kernels (`RowsLoRA`) or, without
    them, segments per run give the plain ops' output and gradients."""
    from marlaas.model import kernels

    g = torch.Generator().manual_seed(11 + scaled)
    counts = {3: 37, 0: 5, 1: 90, 4: 1}  # lane 2 has no tokens
    lane_N = torch.cat([torch.full((n,), lane) for lane, n in counts.items()])
    N, L, fan_in, fan_out, r = int(lane_N.shape[0]), 5, 40, 24, 8
    scale_L = torch.rand(L, generator=g) + 0.5
    x = torch.randn(1, N, fan_in, generator=g)
    A = torch.randn(L, r, fan_in, generator=g)
    Bw = torch.randn(L, fan_out, r, generator=g)
    y = torch.randn(1, N, fan_out, generator=g)
    grad_out = torch.randn(1, N, fan_out, generator=g)

    def run(fast: bool) -> list[Tensor]:
        leaves = [t.clone().requires_grad_(True) for t in (x, A, Bw, y)]
        xl, Al, Bl, yl = leaves
        if fast:
            plan = LanePlan.of(
                lane_N, L, scale_L if scaled else None, scale_L[lane_N], tokens=1, rank=r
            )
            assert plan.segments is not None and plan.lane_K is not None  # pieces per run
            assert plan.segments.pieces < N // 4
            with contextlib.nullcontext() if native else kernels.torch_path():
                out = plan.apply(xl, Al, Bl, yl.clone(), rows=N, tokens=1)
            assert ("RowsLoRA" in type(out.grad_fn).__name__) == native
        else:
            scale = scale_L if scaled else torch.ones(L)
            out = _plain(xl[0, :, None], Al, Bl, yl[0, :, None], lane_N, scale).view(1, N, -1)
        out.backward(grad_out)
        return [out.detach()] + [torch.zeros_like(t) if t.grad is None else t.grad for t in leaves]

    for fast, plain in zip(run(True), run(False), strict=True):
        # weight gradients sum up to 90 tokens: float32 rounding of sums of that size
        torch.testing.assert_close(fast, plain, rtol=1e-4, atol=5e-5)


def test_runs_segments_bound_padding() -> None:
    """`Segments.of_runs`: each run cut into pieces of one size, every row once in its
    own lane's piece, padding repeating the run's first row, and the padded rows few."""
    from marlaas.model.lane_plan import PIECE_ROWS, Segments

    runs = [(3, 37), (0, 5), (1, 90), (4, 1)]
    seg, lanes_P = Segments.of_runs(runs, torch.device("cpu"))
    gather, inverse = seg.gather.tolist(), seg.inverse.tolist()
    assert len(gather) == seg.pieces * seg.size and len(lanes_P) == seg.pieces
    lane_of_row = [lane for lane, n in runs for _ in range(n)]
    assert [gather[i] for i in inverse] == list(range(133))
    for i, row in enumerate(gather):
        assert lane_of_row[row] == lanes_P[i // seg.size]
    cost = seg.pieces * (seg.size + PIECE_ROWS)
    for size in (1, 2, 4, 8, 16, 32, 64, 90):  # the chosen size is the cheapest
        assert cost <= sum(-(-n // size) for _, n in runs) * (size + PIECE_ROWS)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("x_grad", [True, False])
@pytest.mark.parametrize("switched_off", [False, True])
def test_linear_and_lora_as_one_node_match_autograd(
    bias: bool, x_grad: bool, switched_off: bool
) -> None:
    """`LanePlan.linear` on a packed micro-batch: the base layer and the LoRA update in one
    node (`RowsLoRA` with the base layer, the input gradient one buffer) give the plain ops'
    output and gradients; so does its backward when the kernels were switched off after
    the forward (torch's way)."""
    from marlaas.model import kernels

    g = torch.Generator().manual_seed(5 + bias + 2 * x_grad)
    counts = {2: 21, 0: 7, 3: 40}  # lane 1 absent
    lane_N = torch.cat([torch.full((n,), lane) for lane, n in counts.items()])
    N, L, fan_in, fan_out, r = int(lane_N.shape[0]), 4, 24, 40, 8
    scale_L = torch.rand(L, generator=g) + 0.5
    x = torch.randn(1, N, fan_in, generator=g)
    W = torch.randn(fan_out, fan_in, generator=g)
    b = torch.randn(fan_out, generator=g) if bias else None
    A = torch.randn(L, r, fan_in, generator=g)
    Bw = torch.randn(L, fan_out, r, generator=g)
    grad_out = torch.randn(1, N, fan_out, generator=g)

    def run(fast: bool) -> list[Tensor]:
        xl = x.clone().requires_grad_(x_grad)
        Al, Bl = A.clone().requires_grad_(True), Bw.clone().requires_grad_(True)
        if fast:
            plan = LanePlan.of(lane_N, L, scale_L, scale_L[lane_N], tokens=1, rank=r)
            out = plan.linear(xl, W, b, Al, Bl, rows=N, tokens=1)
            assert out is not None
            assert RowsLoRA.__name__ in type(out.grad_fn).__name__
            with kernels.torch_path() if switched_off else contextlib.nullcontext():
                out.backward(grad_out)
        else:
            base = torch.nn.functional.linear(xl, W, b)
            out = _plain(xl[0, :, None], Al, Bl, base[0, :, None], lane_N, scale_L).view(1, N, -1)
            out.backward(grad_out)
        grads = [xl.grad if x_grad else None, Al.grad, Bl.grad]
        return [out.detach()] + [torch.zeros(1) if t is None else t for t in grads]

    for fast, plain in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(fast, plain, rtol=1e-4, atol=5e-5)


def test_linear_as_one_node_only_where_it_applies() -> None:
    """No fused node without gradients (the engine), for a base weight that trains, or
    for rows that are not a packed micro-batch's runs: `None`, the caller's usual path."""
    lane_N = torch.cat([torch.full((9,), 1), torch.full((30,), 0)])
    plan = LanePlan.of(lane_N, 2, torch.ones(2), torch.ones(39), tokens=1, rank=4)
    x, W = torch.randn(1, 39, 8), torch.randn(6, 8)
    A = torch.randn(2, 4, 8, requires_grad=True)
    Bw = torch.randn(2, 6, 4, requires_grad=True)
    with torch.no_grad():
        assert plan.linear(x, W, None, A, Bw, rows=39, tokens=1) is None
    assert plan.linear(x, W.clone().requires_grad_(True), None, A, Bw, rows=39, tokens=1) is None
    blocks = LanePlan.of(torch.tensor([0, 0, 1, 1]), 2, torch.ones(2), torch.ones(4), 8, 4)
    assert blocks.linear(torch.randn(4, 8, 8), W, None, A, Bw, rows=4, tokens=8) is None


@pytest.mark.parametrize(
    "lanes",
    [
        [1, 1, 1, 0, 0, 0],  # blocks of three rows: one tenant's prompts in a prefill
        [0, 0, 1, 1, 2, 2],  # one block per lane, in lane order
        [2, 0, 1, 2],  # a row each
    ],
)
def test_without_gradients_every_layout_runs_in_the_native_kernel(lanes: list[int]) -> None:
    """No gradient (the engine): whatever the blocks, every row's update is added by
    the native kernel in place (`RowLanes`), equal to the plain ops."""
    from marlaas.model import kernels

    assert kernels.native_kernels("lora_rows")
    g = torch.Generator().manual_seed(len(lanes))
    lane_B = torch.tensor(lanes)
    B, T, L, fan_in, fan_out, r = len(lanes), 5, 3, 24, 40, 4
    scale_L = torch.rand(L, generator=g) + 0.5
    x = torch.randn(B, T, fan_in, generator=g)
    A = torch.randn(L, r, fan_in, generator=g)
    Bw = torch.randn(L, fan_out, r, generator=g)
    y = torch.randn(B, T, fan_out, generator=g)
    want = _plain(x, A, Bw, y.clone(), lane_B, scale_L)
    plan = LanePlan.of(lane_B, L, scale_L, scale_L[lane_B], T, r)
    assert plan.rows is not None
    with torch.no_grad():
        got = plan.apply(x, A, Bw, y)
    assert got is y  # in place
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
