"""A decoder layer's element-wise steps as differentiable functions with a fused forward
and backward (`marlaas.model.kernels.fused`) where the native kernels apply (float32 on
the CPU), torch's own ops elsewhere: the same values and gradients up to float rounding
(`tests/model/test_fused.py`).

- `swiglu(g, u) = silu(g) * u`: one pass forward, one backward (torch: two and three,
  plus the activations they save).
- `rotary(x, cos, sin) = x * cos + rotate_half(x) * sin` over `[..., H, D]`: one pass
  each way (torch: five ops forward, as many back).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from marlaas.model import kernels


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
    half = x.shape[-1] // 2
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


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
        if dx is None:  # the kernels were switched off since the forward
            half = dy.shape[-1] // 2
            ds = dy * sin.unsqueeze(-2)
            dx = dy * cos.unsqueeze(-2) - torch.cat((-ds[..., half:], ds[..., :half]), dim=-1)
        return dx, None, None
