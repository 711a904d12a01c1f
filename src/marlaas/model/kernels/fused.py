"""The trainer's element-wise kernels' wrappers (`fused.c`): SwiGLU and its backward,
the rotary embedding and its transpose; see `marlaas.model.kernels`. Each returns a new
tensor, or None where the kernel does not apply (then nothing is written): float32 CPU
tensors, contiguous, of matching shapes."""

from __future__ import annotations

import array
import ctypes
from collections.abc import Sequence

import torch
from torch import Tensor

from marlaas.model.kernels.build import kernel as load


def _ok(*tensors: Tensor) -> bool:
    return all(t.is_cpu and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def _rows_take(x: Tensor, bias: Tensor | None, out_features: int, bias_dtype: torch.dtype) -> bool:
    """A packed product's rows (`_ok`) and bias (none, or `[out_features]` of
    `bias_dtype` on the CPU, contiguous)."""
    return _ok(x) and (
        bias is None
        or (
            bias.is_cpu
            and bias.dtype == bias_dtype
            and bias.is_contiguous()
            and tuple(bias.shape) == (out_features,)
        )
    )


def swiglu_applies(g: Tensor, u: Tensor) -> bool:
    """Whether `swiglu` (and its backward) take these tensors."""
    return load("swiglu") is not None and g.shape == u.shape and _ok(g, u)


def rotary_applies(x: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Whether `rotary` takes these tensors: `x [..., H, D]`, tables `[..., D]`."""
    D = int(x.shape[-1]) if x.dim() else 0
    return (
        load("rotary") is not None
        and x.dim() >= 2
        and D % 2 == 0
        and tuple(cos.shape) == (*x.shape[:-2], D)
        and tuple(sin.shape) == tuple(cos.shape)
        and _ok(x, cos, sin)
    )


def entropy_rows(z_NV: Tensor) -> Tensor | None:
    """Each row's entropy of `softmax(z_NV)`, `[N]` (`fused.c`); None where the kernel
    does not apply (float32 CPU rows, contiguous, every logit finite)."""
    kernel = load("entropy_rows")
    if kernel is None or z_NV.dim() != 2 or not _ok(z_NV) or z_NV.shape[1] < 1:
        return None
    N, V = (int(n) for n in z_NV.shape)
    out = torch.empty(N, dtype=torch.float32)
    nonfinite = ctypes.c_int64(0)
    kernel(N, V, z_NV.data_ptr(), out.data_ptr(), ctypes.addressof(nonfinite))
    return None if nonfinite.value else out


def swiglu(g: Tensor, u: Tensor) -> Tensor | None:
    """`silu(g) * u`."""
    kernel = load("swiglu")
    if kernel is None or not swiglu_applies(g, u):
        return None
    y = torch.empty_like(g)
    kernel(g.numel(), g.data_ptr(), u.data_ptr(), y.data_ptr())
    return y


def swiglu_backward(g: Tensor, u: Tensor, dy: Tensor) -> tuple[Tensor, Tensor] | None:
    """The gradients of `silu(g) * u` with respect to `g` and `u`, given `dy`."""
    kernel = load("swiglu_backward")
    if kernel is None or not (g.shape == u.shape == dy.shape) or not _ok(g, u, dy):
        return None
    dg, du = torch.empty_like(g), torch.empty_like(u)
    kernel(g.numel(), g.data_ptr(), u.data_ptr(), dy.data_ptr(), dg.data_ptr(), du.data_ptr())
    return dg, du


def rotary(x: Tensor, cos: Tensor, sin: Tensor, transpose: bool = False) -> Tensor | None:
    """`x * cos + rotate_half(x) * sin` for `x [..., H, D]` and tables `[..., D]` (the
    leading axes alike), or with `transpose` its transpose (the backward)."""
    kernel = load("rotary")
    if kernel is None or not rotary_applies(x, cos, sin):
        return None
    D = int(x.shape[-1])
    out = torch.empty_like(x)
    T = int(cos.numel()) // D
    kernel(
        T,
        int(x.shape[-2]),
        D,
        x.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        out.data_ptr(),
        int(transpose),
    )
    return out


def adamw_clipped_applies(tensors: Sequence[tuple[Tensor, Tensor, Tensor, Tensor]]) -> bool:
    """Whether `adamw_clipped` takes these tenants' `(p, g, m, v)`: float32 CPU vectors,
    contiguous, of one length per tenant, and the kernel built."""
    return load("adamw_clipped") is not None and all(
        p.numel() == g.numel() == m.numel() == v.numel() and _ok(p, g, m, v)
        for p, g, m, v in tensors
    )


def adamw_clipped(
    tensors: Sequence[tuple[Tensor, Tensor, Tensor, Tensor]], scalars: Sequence[Sequence[float]]
) -> list[float]:
    """Every tenant's AdamW update, its gradient clipped by its own norm first (or not:
    a max_norm <= 0), in one call (`adamw.c`, which has the formula): tenant k's `(p, g, m, v)` (p, m and v updated in place, g read) and
    `(max_norm (<= 0: no clipping), decay, lerp, beta2, bias2_sqrt, eps, step,
    clip_eps)`; the gradients' norms before clipping. The caller checks
    `adamw_clipped_applies`."""
    kernel = load("adamw_clipped")
    assert kernel is not None
    fields = array.array("q")
    for p, g, m, v in tensors:
        fields.extend((p.numel(), p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr()))
    floats = array.array("f", [x for row in scalars for x in row])
    norms = array.array("f", bytes(4 * len(tensors)))
    kernel(len(tensors), fields.buffer_info()[0], floats.buffer_info()[0], norms.buffer_info()[0])
    return norms.tolist()


#: Most rows `half_linear_rows` takes while torch runs more than one thread (it runs in
#: the calling thread; oneDNN spreads a large product over the threads). On one thread
#: it takes any number: at the embedded base's shapes it is ahead of oneDNN (with the
#: conversions around it) at every size, most where oneDNN's ~15 us a call is most of the
#: product (`[M, 128] x [128, 704]`, M 16: 10.5 vs 23.4 us; M 256: 99 vs 113; M 2048:
#: 791 vs 828).
HALF_LINEAR_MAX_ROWS = 64


def half_linear_takes(rows: int) -> bool:
    """Whether `half_linear_rows` takes a product of `rows` rows on this many torch
    threads (`HALF_LINEAR_MAX_ROWS`)."""
    return rows <= HALF_LINEAR_MAX_ROWS or torch.get_num_threads() == 1


def half_pack(weight: Tensor) -> Tensor | None:
    """`weight [N, K]` (bfloat16, contiguous, K even) packed for `half_linear_rows`: per
    block of 16 outputs and pair of inputs, the 16 outputs' two weights side by side
    (zeros past N); None where the kernel does not apply."""
    kernel = load("half_pack")
    if kernel is None or weight.dim() != 2:
        return None
    N, K = (int(n) for n in weight.shape)
    if K % 2 or not (weight.is_cpu and weight.dtype == torch.bfloat16 and weight.is_contiguous()):
        return None
    packed = torch.empty((-(-N // 16), K // 2, 16, 2), dtype=torch.bfloat16)
    kernel(N, K, weight.data_ptr(), packed.data_ptr())
    return packed


def f32_pack(weight: Tensor, transposed: bool = False) -> Tensor | None:
    """`weight [N, K]` (float32, contiguous; with `transposed`, its transpose `[K, N]`,
    read in place) packed for `f32_linear_rows`: per block of 16 outputs and per input,
    the 16 outputs' weights (zeros past the last output); None where the kernel does not
    apply."""
    kernel = load("linear_f32_pack")
    if kernel is None or weight.dim() != 2:
        return None
    if not (weight.is_cpu and weight.dtype == torch.float32 and weight.is_contiguous()):
        return None
    N, K = (int(n) for n in weight.shape)
    out, fan_in, s_out, s_in = (K, N, 1, K) if transposed else (N, K, K, 1)
    packed = torch.empty((-(-out // 16), fan_in, 16), dtype=torch.float32)
    kernel(out, fan_in, weight.data_ptr(), s_out, s_in, packed.data_ptr())
    return packed


def f32_linear_rows(
    x: Tensor, packed: Tensor, out_features: int, bias: Tensor | None
) -> Tensor | None:
    """`x W^T + b` for rows `x [M, K]` (float32) and a float32 weight as `f32_pack`
    packed it (`linear_f32.c`: the 512-bit units, where torch's MKL runs 256-bit on AMD
    CPUs); None where it does not apply. Runs in the calling thread."""
    kernel = load("linear_f32_rows")
    if kernel is None or x.dim() != 2 or x.shape[0] < 1:
        return None
    M, K = (int(n) for n in x.shape)
    N = int(out_features)
    if tuple(packed.shape) != (-(-N // 16), K, 16) or not _rows_take(x, bias, N, torch.float32):
        return None
    y = torch.empty((M, N), dtype=torch.float32)
    kernel(
        M,
        N,
        K,
        x.data_ptr(),
        packed.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        y.data_ptr(),
    )
    return y


def half_linear_rows(
    x: Tensor, packed: Tensor, out_features: int, bias: Tensor | None
) -> Tensor | None:
    """`bf16(bf16(x) W^T + b)` as float32 for rows `x [M, K]` (float32), a bfloat16
    weight `W [out_features, K]` as `half_pack` packed it (and bias), as
    `model.mixed.linear` computes it through torch, without oneDNN's fixed cost
    (`half_linear.c`); None where it does not apply (more than `HALF_LINEAR_MAX_ROWS`
    rows on more than one torch thread, other dtypes or layouts). For a CPU with
    AVX512-BF16 (the caller checks first): built without, the source computes the same
    in plain C, slowly, only so that it builds."""
    if x.dim() != 2 or x.shape[0] < 1 or not half_linear_takes(int(x.shape[0])):
        return None
    M, K = (int(n) for n in x.shape)
    N = int(out_features)
    if tuple(packed.shape) != (-(-N // 16), K // 2, 16, 2) or K % 2:
        return None
    if not _rows_take(x, bias, N, torch.bfloat16):
        return None
    kernel = load("half_linear_rows")
    if kernel is None:
        return None
    y = torch.empty((M, N), dtype=torch.float32)
    scratch = torch.empty(M * K, dtype=torch.bfloat16)
    b = 0 if bias is None else bias.data_ptr()
    kernel(M, N, K, x.data_ptr(), packed.data_ptr(), b, y.data_ptr(), scratch.data_ptr())
    return y
