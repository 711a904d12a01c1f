"""A decoder layer's element-wise steps as differentiable functions with a fused forward
and backward (`marlaas.model.kernels.fused`) where the native kernels apply (float32 on
the CPU), torch's own ops elsewhere: the same values and gradients up to float rounding
(`tests/model/test_fused.py`).

- `swiglu(g, u) = silu(g) * u`: one pass forward, one backward (torch: two and three,
  plus the activations they save).
- `rotary(x, cos, sin) = x * cos + rotate_half(x) * sin` over `[..., H, D]`: one pass
  each way (torch: five ops forward, as many back).
- `rms_norm(x, weight, eps)`: Llama's RMS norm, one pass each way (torch: a composite
  of six ops forward and as many back); None where it does not apply.
- `round_to(x, dtype)`: `x` as a cache of `dtype` holds it, the gradient straight through.
- `span_attention(q, k, v, spans)`: each query over its own span of key columns, the
  trainer's attention (SDPA's masked product covers every column and its CPU backward
  costs twice its forward); native only, None where it does not apply (the caller keeps
  SDPA).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from marlaas.model import kernels
from marlaas.model.kernels import Spans


def swiglu(g: Tensor, u: Tensor) -> Tensor:
    """`silu(g) * u` (the gated MLP of Llama-family decoders)."""
    if not kernels.swiglu_applies(g, u):
        return F.silu(g) * u
    out = _SwiGLU.apply(g, u)
    assert isinstance(out, Tensor)
    return out


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Hugging Face's rotary embedding of `x [..., H, D]` with tables `[..., D]` (the
    leading axes alike, broadcast over the heads `H`)."""
    if kernels.rotary_applies(x, cos, sin):
        out = _Rotary.apply(x, cos, sin)
        assert isinstance(out, Tensor)
        return out
    return x * cos.unsqueeze(-2) + rotate_half(x) * sin.unsqueeze(-2)


def round_to(x: Tensor, dtype: torch.dtype) -> Tensor:
    """`x` rounded to `dtype` and back (as a cache of that dtype holds it), its gradient
    passed through unchanged (rounding's own is zero almost everywhere)."""
    if dtype == x.dtype:
        return x
    out = _RoundTo.apply(x, dtype)
    assert isinstance(out, Tensor)
    return out


class _RoundTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dtype: torch.dtype) -> Tensor:
        return x.to(dtype).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor, None]:
        return grads[0], None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor | None:
    """Llama's RMS norm `weight * x / sqrt(mean(x^2) + eps)` over the last axis, its
    forward and backward each one native pass (`kernels.add_rms_norm`,
    `kernels.rms_norm_backward`; torch's composite backward makes six); None where the
    kernels do not take `x` (float32 CPU, contiguous)."""
    if not (
        x.is_cpu
        and x.dtype == weight.dtype == torch.float32
        and x.is_contiguous()
        and weight.is_contiguous()
        and not kernels.torch_path_on()
        and kernels.native_kernels("add_rms_norm", "rms_norm_backward")
    ):
        return None
    out = _RMSNorm.apply(x, weight, eps)
    assert isinstance(out, Tensor)
    return out


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        E = int(x.shape[-1])
        out = kernels.add_rms_norm(x.view(-1, E), None, weight, eps)
        assert out is not None  # `rms_norm` checked the kernel applies
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return out.view(x.shape)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        E = int(x.shape[-1])
        g = grads[0].contiguous()
        need_w = ctx.needs_input_grad[1]
        out = kernels.rms_norm_backward(x.view(-1, E), weight, g.view(-1, E), ctx.eps, need_w)
        if out is None:  # the kernels were switched off since the forward: torch's way
            with torch.enable_grad():
                x_, w_ = x.detach().requires_grad_(), weight.detach().requires_grad_(need_w)
                y = F.rms_norm(x_, (E,), w_, ctx.eps)
                inputs = (x_, w_) if need_w else (x_,)
                got = torch.autograd.grad(y, inputs, g)
            return got[0], got[1] if need_w else None, None
        g_x, g_w = out
        return g_x.view(x.shape), g_w, None


def rotate_half(x: Tensor) -> Tensor:
    """Hugging Face's `rotate_half`: `[-x2, x1]` for the halves `x1, x2` of the features."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, g: Tensor, u: Tensor) -> Tensor:
        out = kernels.swiglu(g, u)
        assert out is not None  # `swiglu` checked the kernel applies
        ctx.save_for_backward(g, u)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor, Tensor]:
        g, u = ctx.saved_tensors
        out = kernels.swiglu_backward(g, u, grads[0].contiguous())
        if out is None:  # the kernels were switched off since the forward
            with torch.enable_grad():
                g_, u_ = g.detach().requires_grad_(), u.detach().requires_grad_()
                dg, du = torch.autograd.grad(F.silu(g_) * u_, (g_, u_), grads[0])
            return dg, du
        return out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        out = kernels.rotary(x, cos, sin)
        assert out is not None  # `rotary` checked the kernel applies
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        dy = grads[0].contiguous()
        dx = kernels.rotary(dy, cos, sin, transpose=True)
        if dx is None:  # the kernels were switched off since the forward: the transpose
            dx = dy * cos.unsqueeze(-2) - rotate_half(dy * sin.unsqueeze(-2))
        return dx, None, None


def span_attention(
    q_BTHD: Tensor, k_BHKD: Tensor, v_BHKD: Tensor, spans: Spans, scale: float
) -> Tensor | None:
    """Attention of the queries `q [B, T, H, D]` over keys and values `[B, Hkv, K, D]`,
    query `b * T + t` over its columns of `spans`; `[B, T, H, D]`, or None where the
    native kernels do not take these tensors."""
    if not (
        q_BTHD.is_contiguous()
        and kernels.span_attention_trains(q_BTHD.transpose(1, 2), k_BHKD, v_BHKD, spans)
    ):
        return None
    out = _SpanAttention.apply(q_BTHD, k_BHKD, v_BHKD, *spans, scale)
    assert isinstance(out, Tensor)
    return out


class _SpanAttention(torch.autograd.Function):
    # The spans go in as their parts: `apply` takes tensors and plain values.
    @staticmethod
    def forward(
        ctx: Any,
        q_BTHD: Tensor,
        k: Tensor,
        v: Tensor,
        start_Q: Tensor,
        end_Q: Tensor,
        widest: int,
        scale: float,
    ) -> Tensor:
        spans = Spans(start_Q, end_Q, widest)
        result = kernels.span_attention_lse(q_BTHD.transpose(1, 2), k, v, spans, scale)
        assert result is not None  # `span_attention` checked the kernel applies
        out, lse = result
        ctx.save_for_backward(q_BTHD, k, v, out, lse, start_Q, end_Q)
        ctx.widest, ctx.scale = widest, scale
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, start_Q, end_Q = ctx.saved_tensors
        spans = Spans(start_Q, end_Q, ctx.widest)
        dout = grads[0].contiguous()
        result = kernels.span_attention_backward(
            q.transpose(1, 2), k, v, spans, ctx.scale, out, dout, lse
        )
        if result is None:  # the kernels were switched off since the forward
            result = _span_attention_grads(q, k, v, spans, ctx.scale, dout)
        dq, dk, dv = result
        return dq, dk, dv, None, None, None, None


def _span_attention_grads(
    q_BTHD: Tensor, k: Tensor, v: Tensor, spans: Spans, scale: float, dout: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The same gradients through SDPA with the spans as a mask (torch's ops)."""
    B, T, H, _ = q_BTHD.shape
    col_K = torch.arange(int(k.shape[2]))
    mask = (col_K >= spans.start_Q[:, None]) & (col_K < spans.end_Q[:, None])
    with torch.enable_grad():
        q_, k_, v_ = (t.detach().requires_grad_() for t in (q_BTHD, k, v))
        out = F.scaled_dot_product_attention(
            q_.transpose(1, 2),
            k_,
            v_,
            attn_mask=mask.view(B, 1, T, -1),
            scale=scale,
            enable_gqa=int(k.shape[1]) != H,
        )
        dq, dk, dv = torch.autograd.grad(out.transpose(1, 2), (q_, k_, v_), dout)
    return dq, dk, dv
