"""The fused element-wise steps (`marlaas.model.fused`) give torch's values and gradients:
SwiGLU and the rotary embedding through the native kernels (float32 on the CPU) and
through torch's ops (another dtype, kernels off), forward and backward; the kernels
decline what they do not take."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from marlaas.model import fused, kernels
from marlaas.model.fused import rotary, swiglu
from marlaas.model.kernels import Spans


def _rotary_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


def _tables(shape: tuple[int, ...], dim: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    angles = torch.rand(*shape, dim // 2, generator=g) * 6.0
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _check(dtype: torch.dtype, atol: float) -> None:
    g = torch.Generator().manual_seed(0)
    gate = (torch.randn(3, 5, 40, generator=g) * 3).to(dtype).requires_grad_()
    up = torch.randn(3, 5, 40, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(3, 5, 40, generator=g).to(dtype)
    got = swiglu(gate, up)
    want = F.silu(gate) * up
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    for a, b in zip(
        torch.autograd.grad(got, (gate, up), dy),
        torch.autograd.grad(want, (gate, up), dy),
        strict=True,
    ):
        torch.testing.assert_close(a, b, atol=atol, rtol=0)

    x = torch.randn(3, 5, 4, 16, generator=g).to(dtype).requires_grad_()  # [B, T, H, D]
    cos, sin = (t.to(dtype) for t in _tables((3, 5), 16, g))
    dy = torch.randn(3, 5, 4, 16, generator=g).to(dtype)
    got = rotary(x, cos, sin)
    want = _rotary_reference(x, cos, sin)
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    (a,) = torch.autograd.grad(got, x, dy)
    (b,) = torch.autograd.grad(want, x, dy)
    torch.testing.assert_close(a, b, atol=atol, rtol=0)


def test_native_values_and_gradients_equal_torchs() -> None:
    x, cos = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 8)
    assert kernels.swiglu_applies(x, x) and kernels.rotary_applies(x, cos, cos)
    _check(torch.float32, atol=2e-6)


def test_torchs_ops_where_the_kernels_do_not_apply(no_native_kernels: None) -> None:
    x = torch.randn(2, 3, 4, 8)
    assert not kernels.swiglu_applies(x, x)
    _check(torch.float32, atol=0.0)
    _check(torch.float64, atol=0.0)


def test_the_kernels_decline_without_writing() -> None:
    x, cos = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 8)
    assert kernels.swiglu(x.double(), x.double()) is None
    assert kernels.swiglu(x, x[:, :2]) is None
    assert kernels.swiglu(x.transpose(0, 1), x.transpose(0, 1)) is None  # not contiguous
    assert kernels.swiglu_backward(x, x, x.bfloat16()) is None
    assert kernels.rotary(x, cos[:, :2], cos[:, :2]) is None  # tables of other tokens
    assert (
        kernels.rotary(torch.randn(2, 3, 4, 7), torch.randn(2, 3, 7), torch.randn(2, 3, 7)) is None
    )
    assert kernels.rotary(x.transpose(1, 2).contiguous().transpose(1, 2), cos, cos) is None


def _spans(lengths: list[int], firsts: list[int], past: int, new: int, window: int | None) -> Spans:
    """Row b's valid keys are columns [firsts[b], past + lengths[b]); its query t attends
    them up to its own column (within `window`), a padding query its own column."""
    start, end = [], []
    for first, n in zip(firsts, lengths, strict=True):
        for t in range(new):
            stop = past + t + 1
            if t < n:
                start.append(max(first, stop - window) if window else first)
            else:
                start.append(stop - 1)
            end.append(stop)
    s, e = torch.tensor(start), torch.tensor(end)
    return Spans(s, e, int((e - s).max()))


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "window"),
    # ... and groups past the eight heads the backward's registers take at once.
    [(4, 2, 32, None), (4, 4, 16, 3), (6, 2, 24, None), (2, 1, 64, 5), (12, 1, 32, None)],
)
def test_span_attention_and_its_backward_equal_sdpas(
    heads: int, kv_heads: int, dim: int, window: int | None
) -> None:
    g = torch.Generator().manual_seed(heads * dim)
    B, past, new = 3, 4, 21  # more than sixteen columns: the kernels' vector path too
    q = torch.randn(B, new, heads, dim, generator=g, dtype=torch.float64).float()
    kv_cols = past + new
    # Keys and values as the trainer has them: a transposed view of [B, K, Hkv, D].
    k = torch.randn(B, kv_cols, kv_heads, dim, generator=g).transpose(1, 2)
    v = torch.randn(B, kv_cols, kv_heads, dim, generator=g).transpose(1, 2)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    spans = _spans([new, 9, 2], [0, 3, 1], past, new, window)
    got = fused.span_attention(q, k, v, spans, dim**-0.5)
    assert got is not None
    col = torch.arange(kv_cols)
    mask = ((col >= spans[0][:, None]) & (col < spans[1][:, None])).view(B, 1, new, kv_cols)
    want = F.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=mask, scale=dim**-0.5, enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    dout = torch.randn(got.shape, generator=g)
    for a, b in zip(
        torch.autograd.grad(got, (q, k, v), dout),
        torch.autograd.grad(want, (q, k, v), dout),
        strict=True,
    ):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_span_attention_backward_without_the_kernels_gives_the_same_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Kernels switched off between the forward and the backward: torch's ops finish it."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 5, 4, 16, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 7, 16, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 7, 16, generator=g, requires_grad=True)
    spans = _spans([5, 3], [0, 1], 2, 5, None)
    dout = torch.randn(2, 5, 4, 16, generator=g)
    native = torch.autograd.grad(fused.span_attention(q, k, v, spans, 0.25), (q, k, v), dout)
    out = fused.span_attention(q, k, v, spans, 0.25)
    assert out is not None
    with kernels.torch_path():
        plain = torch.autograd.grad(out, (q, k, v), dout)
    for a, b in zip(native, plain, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_span_attention_steps_aside_on_torchs_path() -> None:
    """Inside `kernels.torch_path()` the caller gets None (and keeps SDPA), not a kernel
    that declines halfway."""
    q, k = torch.randn(1, 3, 2, 16), torch.randn(1, 2, 3, 16)
    spans = _spans([3], [0], 0, 3, None)
    assert fused.span_attention(q, k, k, spans, 0.25) is not None
    with kernels.torch_path():
        assert fused.span_attention(q, k, k, spans, 0.25) is None


@pytest.mark.parametrize("weight_grad", [False, True])
@pytest.mark.parametrize("switched_off", [False, True])
def test_rms_norm_and_its_backward_equal_torchs(weight_grad: bool, switched_off: bool) -> None:
    """`fused.rms_norm`: torch's `rms_norm` values and gradients (of the input, and of the
    weight when it trains), features off the vector width, large and tiny scales; its
    backward falls back to torch's when the kernels were switched off after the forward;
    None where the kernels do not take the input."""
    g = torch.Generator().manual_seed(4)
    for scale in (1.0, 1e3, 1e-3):
        x = (torch.randn(3, 7, 37, generator=g) * scale).requires_grad_()
        w = (torch.rand(37, generator=g) + 0.5).requires_grad_(weight_grad)
        dy = torch.randn(3, 7, 37, generator=g)
        got = fused.rms_norm(x, w, 1e-6)
        assert got is not None and "RMSNorm" in type(got.grad_fn).__name__
        want = F.rms_norm(x, (37,), w, 1e-6)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        inputs = (x, w) if weight_grad else (x,)
        with kernels.torch_path() if switched_off else contextlib.nullcontext():
            got_grads = torch.autograd.grad(got, inputs, dy)
        for a, b in zip(got_grads, torch.autograd.grad(want, inputs, dy), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 / scale)
    assert (
        fused.rms_norm(
            torch.randn(2, 4, dtype=torch.float64), torch.ones(4, dtype=torch.float64), 1e-6
        )
        is None
    )
    with kernels.torch_path():
        assert fused.rms_norm(torch.randn(2, 4), torch.ones(4), 1e-6) is None
