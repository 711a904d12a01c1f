"""The span attention kernel's wrapper (`span_attention.c`; see `marlaas.model.kernels`)."""

from __future__ import annotations

import torch
from torch import Tensor

from marlaas.model.kernels.build import kernel as load


def span_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    start_Q: Tensor,
    end_Q: Tensor,
    widest: int,
    scale: float,
    softcap: float | None,
) -> Tensor | None:
    """Attention of `query [R, H, N, D]` (N tokens per cache row) where query token `n`
    of row `r`, `q = r * N + n`, attends columns `[start_Q[q], end_Q[q])` of row `r` of
    `key`/`value [R, Hkv, S, D]`; `[R, N, H, D]`, or None where the kernel does not
    apply (see the module doc). `start_Q`/`end_Q` are contiguous int64 CPU tensors of
    `R * N` entries with `0 <= start < end <= S`; `widest` is the largest `end - start`
    (0: some query attends no column, which the kernel does not take)."""
    kernel = load("span_attention")
    R, H, N, D = query.shape
    Hkv = int(key.shape[1])
    if (
        kernel is None
        or widest < 1
        or widest > int(key.shape[2])
        or H % Hkv
        or not (query.is_cpu and key.is_cpu and value.is_cpu)
        or not (query.dtype == key.dtype == value.dtype == torch.float32)
        or key.stride() != value.stride()
        or key.stride(-1) != 1
        or query.stride(-1) != 1
        or start_Q.dtype != torch.int64
        or int(start_Q.shape[0]) != R * N
        or not (start_Q.is_contiguous() and end_Q.is_contiguous())
    ):
        return None
    out = torch.empty((R, N, H, D), dtype=torch.float32)
    scratch = torch.empty((H // Hkv) * widest, dtype=torch.float32)
    kernel(
        R,
        N,
        H,
        Hkv,
        D,
        query.data_ptr(),
        query.stride(0),
        query.stride(1),
        query.stride(2),
        key.data_ptr(),
        value.data_ptr(),
        key.stride(0),
        key.stride(1),
        key.stride(2),
        start_Q.data_ptr(),
        end_Q.data_ptr(),
        float(scale),
        float(softcap or 0.0),
        out.data_ptr(),
        scratch.data_ptr(),
    )
    return out
