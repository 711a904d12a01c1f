"""The engine decoder's element-wise kernels' wrappers: rotary with the cache write
(`rope_store.c`), the residual add with the RMS norm (`rms_norm.c`, and the norm's
backward for the trainer), the slot cache's row moves (`copy_rows.c`) and the decode
batch's sampling (`sample_rows.c`); see `marlaas.model.kernels`."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
from torch import Tensor

from marlaas.model.kernels.build import kernel as load


def rope_store(
    q_THD: Tensor,
    k_THD: Tensor,
    v_THD: Tensor,
    cos_TR: Tensor,
    sin_TR: Tensor,
    keys: Tensor,
    values: Tensor,
    row_T: Tensor,
    col_T: Tensor,
) -> bool:
    """Rotate the queries `q_THD` in place and write the rotated keys `k_THD` and the
    values `v_THD` of token `t` into cache row `row_T[t]`, column `col_T[t]` of `keys` /
    `values [rows, Hkv, S, D]` (float32, or bfloat16: rounded as `Tensor.to` rounds);
    False (nothing written) where the kernel does not apply (see the module doc). The
    rotation is Hugging Face's `x * cos + rotate_half(x) * sin` on the first `rot`
    features (`cos_TR`/`sin_TR [T, rot]`, contiguous, `rot` even and
    at most `D`). Queries, keys and values have their heads and features contiguous (any
    token stride); `row_T`/`col_T` are contiguous int64 and inside the buffers (the
    caller's guarantee: the kernel writes there unchecked)."""
    kernel = load("rope_store")
    T, H, D = q_THD.shape
    Hkv = int(k_THD.shape[1])
    rot = int(cos_TR.shape[-1])
    tensors = (q_THD, k_THD, v_THD, cos_TR, sin_TR)
    if (
        kernel is None
        or not all(t.is_cpu and t.dtype == torch.float32 for t in tensors)
        or not (keys.is_cpu and values.is_cpu and keys.dtype == values.dtype)
        or keys.dtype not in (torch.float32, torch.bfloat16)
        or any(t.stride(-1) != 1 or t.stride(-2) != D for t in (q_THD, k_THD, v_THD))
        or tuple(v_THD.shape) != tuple(k_THD.shape)
        or int(k_THD.shape[0]) != T
        or int(keys.shape[1]) != Hkv
        or int(keys.shape[-1]) != D
        or keys.stride() != values.stride()
        or keys.stride(-1) != 1
        or rot % 2
        or rot > D
        or tuple(cos_TR.shape) != (T, rot)
        or not (cos_TR.is_contiguous() and sin_TR.is_contiguous())
        or not all(t.dtype == torch.int64 and t.is_contiguous() for t in (row_T, col_T))
        or int(row_T.shape[0]) != T
        or int(col_T.shape[0]) != T
    ):
        return False
    kernel(
        T,
        H,
        Hkv,
        D,
        rot,
        q_THD.data_ptr(),
        q_THD.stride(0),
        k_THD.data_ptr(),
        k_THD.stride(0),
        v_THD.data_ptr(),
        v_THD.stride(0),
        cos_TR.data_ptr(),
        sin_TR.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        row_T.data_ptr(),
        col_T.data_ptr(),
        int(keys.dtype == torch.bfloat16),
    )
    return True


def add_rms_norm(
    h_TE: Tensor, delta_TE: Tensor | None, weight_E: Tensor, eps: float
) -> Tensor | None:
    """`h_TE += delta_TE` in place (when given), then `weight_E * h / sqrt(mean(h^2) +
    eps)` per token as a new tensor (Llama's RMS norm); None (nothing written) where the
    kernel does not apply (see the module doc): float32 CPU tensors, contiguous."""
    kernel = load("add_rms_norm")
    T, E = h_TE.shape
    if (
        kernel is None
        or not (h_TE.is_cpu and weight_E.is_cpu and h_TE.dtype == weight_E.dtype == torch.float32)
        or not (h_TE.is_contiguous() and weight_E.is_contiguous())
        or tuple(weight_E.shape) != (E,)
        or (
            delta_TE is not None
            and (
                not delta_TE.is_cpu
                or delta_TE.dtype != torch.float32
                or not delta_TE.is_contiguous()
                or tuple(delta_TE.shape) != (T, E)
            )
        )
    ):
        return None
    out = torch.empty((T, E), dtype=torch.float32)
    kernel(
        T,
        E,
        h_TE.data_ptr(),
        0 if delta_TE is None else delta_TE.data_ptr(),
        weight_E.data_ptr(),
        float(eps),
        out.data_ptr(),
    )
    return out


def rms_norm_backward(
    h_TE: Tensor, weight_E: Tensor, g_TE: Tensor, eps: float, weight_grad: bool
) -> tuple[Tensor, Tensor | None] | None:
    """The gradients `(of h, of the weight or None)` of `weight * h / sqrt(mean(h^2) +
    eps)` per token for the output's gradient `g_TE`; None where the kernel does not
    apply: float32 CPU tensors, contiguous, `[T, E]` and `[E]`."""
    kernel = load("rms_norm_backward")
    T, E = h_TE.shape
    if (
        kernel is None
        or not (h_TE.is_cpu and weight_E.is_cpu and g_TE.is_cpu)
        or not (h_TE.dtype == weight_E.dtype == g_TE.dtype == torch.float32)
        or not (h_TE.is_contiguous() and weight_E.is_contiguous() and g_TE.is_contiguous())
        or tuple(weight_E.shape) != (E,)
        or tuple(g_TE.shape) != (T, E)
    ):
        return None
    g_h = torch.empty((T, E), dtype=torch.float32)
    g_w = torch.zeros(E, dtype=torch.float32) if weight_grad else None
    kernel(
        T,
        E,
        h_TE.data_ptr(),
        weight_E.data_ptr(),
        g_TE.data_ptr(),
        float(eps),
        g_h.data_ptr(),
        0 if g_w is None else g_w.data_ptr(),
    )
    return g_h, g_w


def copy_rows(buffer: Tensor, dst: Sequence[int], src: Sequence[int], columns: int) -> bool:
    """Copy rows `src` of a slot cache `buffer [blocks..., rows, heads, columns, D]`
    (float32, or bfloat16 of an even `D`; contiguous; the rows axis third from the end
    of the leading ones) into rows `dst`, their first `columns` columns, in one pass;
    False (nothing written) where the kernel does not apply, or a row is both a source
    and a destination (then the caller must read every source before it writes)."""
    kernel = load("copy_rows")
    if buffer.dtype == torch.bfloat16 and buffer.is_contiguous() and buffer.shape[-1] % 2 == 0:
        buffer = buffer.view(torch.float32)  # moves bytes: two halves are one float
    if (
        kernel is None
        or buffer.dim() < 4
        or buffer.dtype != torch.float32
        or not buffer.is_cpu
        or not buffer.is_contiguous()
        or len(dst) != len(src)
        or not set(dst).isdisjoint(src)
    ):
        return False
    rows, heads, width, D = (int(n) for n in buffer.shape[-4:])
    if not (0 <= columns <= width) or not all(0 <= r < rows for r in (*dst, *src)):
        return False
    moves = len(dst)
    dst_m, src_m = (ctypes.c_int64 * moves)(*dst), (ctypes.c_int64 * moves)(*src)
    kernel(
        buffer.numel() // (rows * heads * width * D),
        rows * heads * width * D,
        heads * width * D,
        heads,
        width * D,
        columns * D,
        moves,
        ctypes.addressof(dst_m),
        ctypes.addressof(src_m),
        buffer.data_ptr(),
    )
    return True


def sample_rows(
    logits_BV: Tensor, temperature_B: Tensor, u_B: Tensor, all_greedy: bool
) -> tuple[Tensor, Tensor] | None:
    """`marlaas.rollout.sampling.sample_B` without top-k / top-p, in one native call:
    `(tokens_B int64, logprobs_B float32)`, or None where the kernel does not apply
    (float32 CPU logits with a contiguous last axis; float32 temperatures and uniforms of
    one per row)."""
    kernel = load("sample_rows")
    if kernel is None or logits_BV.dim() != 2:
        return None
    B, V = (int(n) for n in logits_BV.shape)
    if (
        V < 1
        or not all(t.is_cpu and t.dtype == torch.float32 for t in (logits_BV, temperature_B, u_B))
        or logits_BV.stride(1) != 1
        or tuple(temperature_B.shape) != (B,)
        or tuple(u_B.shape) != (B,)
    ):
        return None
    temperature_B, u_B = temperature_B.contiguous(), u_B.contiguous()
    tokens_B = torch.empty(B, dtype=torch.int64)
    logprobs_B = torch.empty(B, dtype=torch.float32)
    scratch = torch.empty(V, dtype=torch.float32)
    kernel(
        B,
        V,
        logits_BV.data_ptr(),
        logits_BV.stride(0),
        temperature_B.data_ptr(),
        u_B.data_ptr(),
        tokens_B.data_ptr(),
        logprobs_B.data_ptr(),
        scratch.data_ptr(),
        int(all_greedy),
    )
    return tokens_B, logprobs_B
