"""The native per-row LoRA update (`marlaas.model.kernels.lora_rows`) equals the plain
product for every row's own lane (both layouts of B, scales or none, ranks with and
without a specialised loop, features off the vector width, several tokens a row, any
order), declines what it does not take without writing, and is what `LanePlan` runs
for a decode batch without gradients, and not with them."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from marlaas.model import kernels
from marlaas.model.kernels.build import kernel as load
from marlaas.model.lane_layers import LaneGrads
from marlaas.model.lane_plan import LanePlan


def reference(x: Tensor, y: Tensor, A: Tensor, B: Tensor, lane: Tensor, scale: Tensor | None):
    """Row by row in float64: `y + s * B[l] (A[l] x)`."""
    out = y.double().clone()
    for n in range(x.shape[0]):
        k = int(lane[n])
        s = 1.0 if scale is None else float(scale[k])
        out[n] += s * (x[n].double() @ A[k].double().T) @ B[k].double().T
    return out


def weights(L: int, r: int, fan_in: int, fan_out: int, rank_major: bool, g: torch.Generator):
    """Views of bigger slot buffers (rank cut), as the adapter bank hands them over."""
    A = torch.randn(L, r + 3, fan_in, generator=g)[:, :r]
    if rank_major:
        B = torch.randn(L, r + 3, fan_out, generator=g).transpose(1, 2)[:, :, :r]
    else:
        B = torch.randn(L, fan_out, r + 3, generator=g)[:, :, :r]
    return A, B


@pytest.mark.parametrize(
    ("r", "fan_in", "fan_out", "T", "rank_major", "scaled"),
    [
        (8, 128, 352, 1, True, False),  # the embedded base's MLP, as the bank holds it
        (16, 64, 40, 1, True, True),
        (5, 24, 17, 3, False, True),  # no specialised rank, features off the vector width
        (8, 33, 130, 2, False, False),
        (12, 16, 64, 1, True, False),  # a rank group past r (12 = 8 + 4)
        (8, 33, 70, 1, False, True),  # one-token rows in pairs, features off the width
        (8, 128, 352, 7, True, True),  # rows of several tokens: in pairs, one left
    ],
)
def test_equals_each_rows_own_lane(
    r: int, fan_in: int, fan_out: int, T: int, rank_major: bool, scaled: bool
) -> None:
    assert kernels.native_kernels()
    g = torch.Generator().manual_seed(r * 1000 + fan_in)
    L, N = 6, 11
    A, B = weights(L, r, fan_in, fan_out, rank_major, g)
    lane = torch.tensor([3, 0, 5, 3, 1, 1, 5, 2, 3, 0, 4])
    scale = torch.rand(L, generator=g) if scaled else None
    x, y = torch.randn(N, T, fan_in, generator=g), torch.randn(N, T, fan_out, generator=g)
    want = reference(x, y, A, B, lane, scale)
    for order in (torch.argsort(lane, stable=True), torch.randperm(N, generator=g)):
        got = y.clone()
        assert kernels.lora_rows(x, got, A, B, lane, order, scale)
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)


def test_declines_what_it_does_not_take_and_writes_nothing() -> None:
    g = torch.Generator().manual_seed(0)
    A, B = weights(3, 4, 8, 8, True, g)
    lane, order = torch.tensor([0, 2]), torch.tensor([0, 1])
    x, y = torch.randn(2, 1, 8, generator=g), torch.randn(2, 1, 8, generator=g)
    before = y.clone()
    declined = {
        "float64": (x.double(), y.double(), A.double(), B.double(), lane, order, None),
        "a strided input": (torch.randn(2, 1, 16)[:, :, ::2], y, A, B, lane, order, None),
        "B strided on both axes": (x, y, A, torch.randn(3, 8, 8)[:, :, ::2], lane, order, None),
        "A strided along in": (
            x,
            y,
            A.transpose(1, 2).contiguous().transpose(1, 2),
            B,
            lane,
            order,
            None,
        ),
        "int32 lanes": (x, y, A, B, lane.int(), order, None),
        "float64 scales": (x, y, A, B, lane, order, torch.ones(3, dtype=torch.float64)),
        "a rank past the kernel's buffer": (
            x,
            y,
            *weights(3, 65, 8, 8, True, g),
            lane,
            order,
            None,
        ),
    }
    for case, args in declined.items():
        assert not kernels.lora_rows(*args), case
    assert torch.equal(y, before)
    assert kernels.lora_rows(x, y, A, B, lane, order, None)
    assert not torch.equal(y, before)


def test_switched_off_it_declines(no_native_kernels: None) -> None:
    A, B = weights(2, 4, 8, 8, True, torch.Generator().manual_seed(1))
    x, y = torch.randn(1, 1, 8), torch.randn(1, 1, 8)
    assert not kernels.lora_rows(x, y, A, B, torch.tensor([1]), torch.tensor([0]), None)


def test_lane_plan_runs_it_without_gradients_only(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(2)
    L, N, r = 5, 12, 8
    A, B = weights(L, r, 16, 24, True, g)
    lane = torch.tensor([1, 2, 3, 4] * 3)  # interleaved lanes: a decode batch's segments
    plan = LanePlan.of(lane, L, None, torch.ones(N), 1, r)
    assert plan.rows is not None and plan.segments is not None
    x, y = torch.randn(N, 1, 16, generator=g), torch.randn(N, 1, 24, generator=g)
    want = reference(x, y, A, B, lane, None)
    calls: list[bool] = []
    real = kernels.lora_rows

    def counted(*args: object, **kwargs: object) -> bool:
        calls.append(real(*args, **kwargs))  # type: ignore[arg-type]
        return calls[-1]

    monkeypatch.setattr("marlaas.model.lane_plan.lora_rows", counted)
    with torch.inference_mode():
        got = plan.apply(x, A, B, y.clone())
    assert calls == [True]
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
    # With gradients the segments run (autograd needs the ops), to the same values.
    A_grad = A.detach().clone().requires_grad_(True)
    out = plan.apply(x, A_grad, B, y.clone())
    assert calls == [True]
    torch.testing.assert_close(out.detach().double(), want, atol=1e-4, rtol=1e-5)
    out.sum().backward()
    assert A_grad.grad is not None and A_grad.grad[1:].abs().sum() > 0


@pytest.mark.parametrize(
    ("r", "fan_in", "fan_out", "T", "rank_major", "scaled"),
    [
        (8, 128, 352, 1, False, True),  # the trainer's stacked lanes (PEFT's layout of B)
        (16, 64, 40, 1, True, False),
        (5, 24, 17, 3, False, True),  # no specialised rank, features off the vector width
        (12, 33, 130, 2, True, True),
    ],
)
def test_backward_equals_autograd(
    r: int, fan_in: int, fan_out: int, T: int, rank_major: bool, scaled: bool
) -> None:
    """`lora_rows_backward`'s gradients of x, A and B equal autograd's of the definition
    in float64, each row under its own lane, in any order (lanes repeated and absent)."""
    g = torch.Generator().manual_seed(r * 100 + fan_out)
    L, N = 6, 13
    A, B = weights(L, r, fan_in, fan_out, rank_major, g)
    lane = torch.tensor([3, 0, 5, 3, 1, 1, 5, 3, 3, 0, 1, 5, 0])  # lanes 2 and 4 absent
    scale = torch.rand(L, generator=g) + 0.5 if scaled else None
    x, grad = torch.randn(N, T, fan_in, generator=g), torch.randn(N, T, fan_out, generator=g)
    xd, Ad, Bd = (t.double().requires_grad_(True) for t in (x, A, B))
    reference(xd, torch.zeros(N, T, fan_out), Ad, Bd, lane, scale).backward(grad.double())
    for order in (torch.argsort(lane, stable=True), torch.randperm(N, generator=g)):
        out = kernels.lora_rows_backward(x, grad, A, B, lane, order, scale)
        assert out is not None
        for got, want in zip(out, (xd.grad, Ad.grad, Bd.grad), strict=True):
            assert got.shape == want.shape
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_backward_adds_into_a_given_input_gradient_or_skips_it() -> None:
    """`g_x` given: the update's input gradient is added into it (a base layer's already
    there); `need_x=False`: not computed at all; the weight gradients alike either way."""
    g = torch.Generator().manual_seed(9)
    L, N, r, fan_in, fan_out = 3, 10, 8, 32, 48
    A, B = weights(L, r, fan_in, fan_out, False, g)
    lane, scale = torch.tensor([2, 0, 0, 1, 2, 2, 1, 0, 1, 2]), torch.rand(L, generator=g)
    order = torch.argsort(lane, stable=True)
    x, grad = torch.randn(N, 1, fan_in, generator=g), torch.randn(N, 1, fan_out, generator=g)
    gx, gA, gB = kernels.lora_rows_backward(x, grad, A, B, lane, order, scale)
    base = torch.randn(N, 1, fan_in, generator=g)
    into = base.clone()
    gx2, gA2, gB2 = kernels.lora_rows_backward(x, grad, A, B, lane, order, scale, g_x=into)
    assert gx2 is into
    torch.testing.assert_close(into, base + gx)
    none, gA3, gB3 = kernels.lora_rows_backward(x, grad, A, B, lane, order, scale, need_x=False)
    assert none is None
    for got in (gA2, gA3):
        torch.testing.assert_close(got, gA)
    for got in (gB2, gB3):
        torch.testing.assert_close(got, gB)


def test_gather_grads_lays_out_each_lanes_flat_gradient() -> None:
    """Lanes' gradients from the kernels' layouts into their flat vectors' rows: A as it
    is, B's rank-major gradient in PEFT's layout (rank 8 in registers, sixteen outputs
    at a time, the rest one by one; other ranks element by element), zeros for a module
    none reached and for a lane no pass reached (fresh: its rows hold anything); exactly.
    What it does not take (bfloat16, a row of another width) it declines without
    writing."""
    g = torch.Generator().manual_seed(0)
    L = 3
    shapes = [(8, 48, 352), (8, 16, 45), (4, 24, 33), (16, 8, 40), (8, 32, 16)]
    modules: list[tuple[LaneGrads | None, int, int, int]] = []
    want = []
    for k, (r, fan_in, fan_out) in enumerate(shapes):
        gA, gBt = torch.randn(L, r, fan_in, generator=g), torch.randn(L, r, fan_out, generator=g)
        fresh = torch.zeros(L, dtype=torch.uint8)
        if k == 2:  # no pass reached it
            modules.append((None, r, fan_in, fan_out))
            want += [torch.zeros(L, r * fan_in), torch.zeros(L, fan_out * r)]
            continue
        if k == 3:  # no pass reached lane 1 (its rows: leftovers)
            fresh[1] = 1
        keep = (1 - fresh).float()[:, None]
        modules.append((LaneGrads(gA, gBt, fresh), r, fan_in, fan_out))
        want += [gA.reshape(L, -1) * keep, gBt.transpose(1, 2).reshape(L, -1) * keep]
    expected = torch.cat(want, dim=1)
    flat = torch.full((L, expected.shape[1] + 5), 7.0)
    assert kernels.gather_grads(modules, flat[:, : expected.shape[1]])
    assert torch.equal(flat[:, : expected.shape[1]], expected)
    assert (flat[:, expected.shape[1] :] == 7.0).all()
    untouched = torch.full((L, expected.shape[1]), 7.0)
    assert not kernels.gather_grads(modules, untouched.bfloat16())
    assert not kernels.gather_grads(modules, torch.full((L, expected.shape[1] + 1), 7.0))
    bf16 = [
        (None if m is None else LaneGrads(m.gA.bfloat16(), m.gBt, m.fresh_L), r, i, o)
        for m, r, i, o in modules
    ]
    assert not kernels.gather_grads(bf16, untouched) and (untouched == 7.0).all()


def test_a_fresh_lanes_first_block_writes_its_gradients() -> None:
    """The backward writes a fresh lane's gradients at its first block (the buffers'
    leftovers never read), adds at the blocks after it and in later calls, and leaves a
    lane it never reaches fresh: the same gradients as zeroed buffers added into."""
    g = torch.Generator().manual_seed(1)
    L, N, T, r, fan_in, fan_out = 4, 9, 9, 8, 48, 40
    A, B = torch.randn(L, r, fan_in, generator=g), torch.randn(L, fan_out, r, generator=g)
    lane = torch.tensor([1, 0, 3, 1, 1, 0, 3, 3, 1])  # lane 2 absent; lane 1 past a block
    order, scale = torch.argsort(lane, stable=True), torch.rand(L, generator=g) + 0.5
    kernel = load("lora_rows_backward_strided")
    assert kernel is not None
    scratch = torch.empty(r * fan_out)
    grads = LaneGrads(
        torch.full((L, r, fan_in), float("nan")),
        torch.full((L, r, fan_out), float("nan")),
        torch.ones(L, dtype=torch.uint8),
    )
    zero_A, zero_Bt = torch.zeros(L, r, fan_in), torch.zeros(L, r, fan_out)
    for _ in range(2):  # two passes into the same buffers
        x = torch.randn(N, T, fan_in, generator=g)
        dy = torch.randn(N, T, fan_out, generator=g)
        for gA, gBt, fresh in ((grads.gA, grads.gBt, grads.fresh_L), (zero_A, zero_Bt, None)):
            kernel(
                N, T, fan_in, fan_out, r, x.data_ptr(), dy.data_ptr(), fan_out, 0,
                A.data_ptr(), *A.stride()[:2], B.data_ptr(), *B.stride(),
                lane.data_ptr(), order.data_ptr(), scale.data_ptr(),
                gA.data_ptr(), gBt.data_ptr(), scratch.data_ptr(), 0,
                0, 0 if fresh is None else fresh.data_ptr(),
            )  # fmt: skip
    assert grads.fresh_L.tolist() == [0, 0, 1, 0]
    gA, gBt = grads.settled()
    assert grads.fresh_L.tolist() == [0, 0, 0, 0]
    torch.testing.assert_close(gA, zero_A, rtol=0, atol=0)
    torch.testing.assert_close(gBt, zero_Bt, rtol=0, atol=0)


@pytest.mark.parametrize("fan_out", [352, 45])
def test_dense_peft_lanes_equal_the_definition(fan_out: int) -> None:
    """Rank 8 with each lane's B dense in PEFT's layout (the trainer's stacked lanes:
    transposed sixteen outputs at a time, the rest one by one): forward and backward
    equal the definition in float64."""
    g = torch.Generator().manual_seed(fan_out)
    L, N, r, fan_in = 4, 11, 8, 48
    A = torch.randn(L, r, fan_in, generator=g)
    B = torch.randn(L, fan_out * r + 5, generator=g)[:, : fan_out * r].view(L, fan_out, r)
    lane = torch.tensor([1, 0, 3, 1, 1, 0, 3, 3, 1, 0, 0])  # lane 2 absent
    order, scale = torch.argsort(lane, stable=True), torch.rand(L, generator=g) + 0.5
    x, grad = torch.randn(N, 1, fan_in, generator=g), torch.randn(N, 1, fan_out, generator=g)
    y = torch.zeros(N, 1, fan_out)
    assert kernels.lora_rows(x, y, A, B, lane, order, scale)
    xd, Ad, Bd = (t.double().requires_grad_(True) for t in (x, A, B))
    want = reference(xd, torch.zeros(N, 1, fan_out), Ad, Bd, lane, scale)
    torch.testing.assert_close(y.double(), want.detach(), rtol=1e-5, atol=1e-5)
    want.backward(grad.double())
    out = kernels.lora_rows_backward(x, grad, A, B, lane, order, scale)
    assert out is not None
    for got, expected in zip(out, (xd.grad, Ad.grad, Bd.grad), strict=True):
        torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)
