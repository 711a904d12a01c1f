"""The span attention kernels' wrapper (`span_attention.c`, and for the trainer
`span_tiles.c`; see `marlaas.model.kernels`)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from marlaas.model.kernels.build import kernel as load


class Spans(NamedTuple):
    """Each query's columns: query `q` attends `[start_Q[q], end_Q[q])` (contiguous int64
    CPU tensors, `0 <= start < end`), and `widest`, the largest `end - start` (0: some
    query attends no column, which the kernels do not take)."""

    start_Q: Tensor
    end_Q: Tensor
    widest: int


def span_attention(
    query: Tensor, key: Tensor, value: Tensor, spans: Spans, scale: float, softcap: float | None
) -> Tensor | None:
    """Attention of `query [R, H, N, D]` (N tokens per cache row) where query token `n`
    of row `r`, `q = r * N + n`, attends its `spans` columns (`R * N` of them, each at
    most `S`) of row `r` of `key`/`value [R, Hkv, S, D]` (float32, or a bfloat16 cache);
    `[R, N, H, D]` float32, or None where the kernel does not apply (see the module
    doc)."""
    out = _forward(query, key, value, spans, scale, softcap, lse=False)
    return None if out is None else out[0]


def span_attention_lse(
    query: Tensor, key: Tensor, value: Tensor, spans: Spans, scale: float
) -> tuple[Tensor, Tensor] | None:
    """`span_attention` (no soft-capping) and each query head's log-sum-exp of its scaled
    scores `[R * N, H]`: what `span_attention_backward` needs."""
    out = _forward(query, key, value, spans, scale, None, lse=True)
    if out is None:
        return None
    assert out[1] is not None
    return out[0], out[1]


def _forward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    spans: Spans,
    scale: float,
    softcap: float | None,
    lse: bool,
) -> tuple[Tensor, Tensor | None] | None:
    half = key.dtype == torch.bfloat16 and not lse
    # The trainer's (with the log-sum-exp its backward needs): a tile of queries at a time
    # (`span_tiles.c`, the same results), where it is built.
    kernel = (load("span_tiles") if lse else None) or load("span_attention")
    R, H, N, D = query.shape
    if kernel is None or not _takes(query, key, value, spans, half):
        return None
    out = torch.empty((R, N, H, D), dtype=torch.float32)
    lse_QH = torch.empty((R * N, H), dtype=torch.float32) if lse else None
    scratch = torch.empty((H // int(key.shape[1])) * spans.widest, dtype=torch.float32)
    kernel(
        *_layout(query, key, value, spans),
        float(scale),
        float(softcap or 0.0),
        out.data_ptr(),
        0 if lse_QH is None else lse_QH.data_ptr(),
        scratch.data_ptr(),
        int(half),
    )
    return out, lse_QH


def span_attention_trains(query: Tensor, key: Tensor, value: Tensor, spans: Spans) -> bool:
    """Whether `span_attention_lse` and `span_attention_backward` both take these
    tensors: built, not switched off (`torch_path`), and of their layouts."""
    return (
        load("span_attention") is not None
        and load("span_attention_backward") is not None
        and _takes(query, key, value, spans)
    )


def span_attention_backward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    spans: Spans,
    scale: float,
    out: Tensor,
    dout: Tensor,
    lse_QH: Tensor,
) -> tuple[Tensor, Tensor, Tensor] | None:
    """The gradients `(dq [R, N, H, D], dk, dv [R, Hkv, S, D] contiguous)` of
    `span_attention_lse`'s output `out [R, N, H, D]` given its gradient `dout` (same
    shape, contiguous) and `lse_QH`, over the forward's spans; None where the kernel
    does not apply."""
    kernel = load("span_tiles_backward") or load("span_attention_backward")
    R, H, N, D = query.shape
    if (
        kernel is None
        or not _takes(query, key, value, spans)
        or not all(t.is_cpu and t.dtype == torch.float32 for t in (out, dout, lse_QH))
        or not (out.is_contiguous() and dout.is_contiguous() and lse_QH.is_contiguous())
        or tuple(out.shape) != (R, N, H, D)
        or tuple(dout.shape) != (R, N, H, D)
        or tuple(lse_QH.shape) != (R * N, H)
    ):
        return None
    # The key gradients are accumulated in buffers of the keys' own layout.
    dk = torch.zeros_like(key, memory_format=torch.preserve_format)
    dv = torch.zeros_like(value, memory_format=torch.preserve_format)
    if dk.stride() != key.stride() or dv.stride() != key.stride():
        dk, dv = torch.zeros(key.shape), torch.zeros(key.shape)
        key, value = key.contiguous(), value.contiguous()
    dq = torch.empty((R, N, H, D), dtype=torch.float32)
    kernel(
        *_layout(query, key, value, spans),
        float(scale),
        out.data_ptr(),
        dout.data_ptr(),
        lse_QH.data_ptr(),
        dq.data_ptr(),
        dk.data_ptr(),
        dv.data_ptr(),
    )
    return dq, dk, dv


def _layout(query: Tensor, key: Tensor, value: Tensor, spans: Spans) -> tuple[int, ...]:
    """The kernels' leading arguments: the sizes, the tensors and their strides."""
    R, H, N, D = query.shape
    return (
        R,
        N,
        H,
        int(key.shape[1]),
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
        spans.start_Q.data_ptr(),
        spans.end_Q.data_ptr(),
    )


def _takes(query: Tensor, key: Tensor, value: Tensor, spans: Spans, half: bool = False) -> bool:
    """Whether the span kernels take these tensors (see `span_attention`): float32, or
    with `half` (the forward over a cache) bfloat16 keys and values."""
    R, H, N, _ = query.shape
    Hkv = int(key.shape[1])
    start_Q, end_Q, widest = spans
    return not (
        widest < 1
        or widest > int(key.shape[2])
        or H % Hkv
        or not (query.is_cpu and key.is_cpu and value.is_cpu)
        or query.dtype != torch.float32
        or not (key.dtype == value.dtype == (torch.bfloat16 if half else torch.float32))
        or key.stride() != value.stride()
        or key.stride(-1) != 1
        or query.stride(-1) != 1
        or start_Q.dtype != torch.int64
        or int(start_Q.shape[0]) != R * N
        or not (start_Q.is_contiguous() and end_Q.is_contiguous())
    )
