"""LoRA updates with hand-written backwards, the trainer's side of `marlaas.model.lane_plan`.

- `BlockLoRA`: blocks of rows, one lane each, as batched matmuls whose rank-wide side is
  an outer dimension (autograd's own backward of the same ops picks layouts several
  times slower at LoRA's shapes and sums per-row weight gradients through a strided
  scatter);
- `RowsLoRA`: every row its own lane through the native per-row kernels both ways
  (`kernels.lora_rows`, `kernels.lora_rows_backward`), for a packed micro-batch whose
  tenants' tokens are runs of their own lengths; optionally with the frozen base layer
  in the same node, so the input gradient is one buffer.

Both give exactly the gradients of the plain ops, up to floating-point rounding
(`tests/model/test_lane_plan_grad.py`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from marlaas.model.kernels import lora_rows, lora_rows_backward
from marlaas.model.mixed import linear as mixed_linear
from marlaas.model.mixed import matmul as mixed_matmul


class BlockLoRA(torch.autograd.Function):
    """`y_Kno + scale_K * (x_Kni A_K^T) B_K^T` (`y_Kno` None: the update alone, as
    segments add it) for blocks `K` of `n` rows, where
    `A_K = A_L[lane_K]` (`lane_K` None: `A_L` itself), with a backward chosen for LoRA's
    shapes: every product is a batched matmul whose rank-wide side is an outer
    dimension, and the per-block weight gradients are summed into their lanes with one
    `index_add_` on contiguous tensors. Exactly the gradients of the plain ops, up to
    floating-point rounding (`tests/model/test_lane_plan_grad.py`)."""

    @staticmethod
    def forward(
        ctx: Any,
        x_Kni: Tensor,
        A_Lri: Tensor,
        B_Lor: Tensor,
        y_Kno: Tensor | None,
        lane_K: Tensor | None,
        scale_K: Tensor | None,
    ) -> Tensor:
        A_Kri = A_Lri if lane_K is None else A_Lri.index_select(0, lane_K)
        B_Kor = B_Lor if lane_K is None else B_Lor.index_select(0, lane_K)
        h_Knr = torch.bmm(x_Kni, A_Kri.transpose(1, 2))
        if scale_K is not None:
            h_Knr = h_Knr * scale_K[:, None, None]
        if y_Kno is None:
            out_Kno = torch.bmm(h_Knr, B_Kor.transpose(1, 2))
        else:
            out_Kno = torch.baddbmm(y_Kno, h_Knr, B_Kor.transpose(1, 2))
        ctx.save_for_backward(x_Kni, A_Kri, B_Kor, h_Knr, lane_K, scale_K)
        ctx.lanes = int(A_Lri.shape[0])
        return out_Kno

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        (g_Kno,) = grads
        x_Kni, A_Kri, B_Kor, h_Knr, lane_K, scale_K = ctx.saved_tensors
        need_x, need_A, need_B, need_y = ctx.needs_input_grad[:4]
        g_x = g_A = g_B = None
        if need_B:  # (h^T g)^T: the rank is the output's row count, not its inner size
            g_B = torch.bmm(h_Knr.transpose(1, 2), g_Kno).transpose(1, 2)
        if need_A or need_x:
            # The gradient of h, transposed ([K, r, n]): the rank as the row count again.
            gh_Krn = torch.bmm(B_Kor.transpose(1, 2), g_Kno.transpose(1, 2))
            if scale_K is not None:
                gh_Krn = gh_Krn * scale_K[:, None, None]
            if need_A:
                g_A = torch.bmm(gh_Krn, x_Kni)
            if need_x:
                g_x = torch.bmm(gh_Krn.transpose(1, 2), A_Kri)
        if lane_K is not None:  # blocks of one lane add up in it
            lanes = ctx.lanes
            if g_A is not None:
                g_A = g_A.new_zeros((lanes, *g_A.shape[1:])).index_add_(0, lane_K, g_A)
            if g_B is not None:
                g_B = g_B.new_zeros((lanes, *g_B.shape[1:])).index_add_(0, lane_K, g_B.contiguous())
        return g_x, g_A, g_B, g_Kno if need_y else None, None, None


class RowsLoRA(torch.autograd.Function):
    """`y + scale * (x A^T) B^T` with each row's own lane (`lane_N`, rows in `order_N`,
    `scale_L` None where the weights carry it), through the native kernels both ways: no
    gather of the rows into per-lane pieces and no copy of the weights per row, so a
    packed micro-batch (each token a row, its tenant's tokens one run) costs its tokens'
    products alone. `y` is added into in place (a copy where it is a view).

    With the base layer instead of `y` (`W`, `b`; `y` None): `F.linear(x, W, b)` plus the
    update as one node, whose input gradient is the base's `g W` with the kernel adding
    the update's part into it, not two tensors autograd then sums (a pass over every
    linear layer's input gradient fewer, and a node fewer per layer). The base is frozen;
    a half `W` (`model.mixed`) multiplies as `mixed.linear` does both ways: `x`, and `g`
    in the backward, rounded to its dtype, the product returned in `x`'s.

    `shape` is the call's `(N, T, in, out, r)` as `kernels.lora_rows_trains` found it
    (the caller checks the kernels take the tensors)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        A_Lri: Tensor,
        B_Lor: Tensor,
        y: Tensor | None,
        W: Tensor | None,
        b: Tensor | None,
        lane_N: Tensor,
        order_N: Tensor,
        scale_L: Tensor | None,
        shape: tuple[int, int, int, int, int],
    ) -> Tensor:
        if y is None:
            assert W is not None
            y = mixed_linear(x, W, b).contiguous()
        elif y._base is not None:  # a view (F.linear's with a bias): autograd needs a copy
            y = y.clone()
        else:
            ctx.mark_dirty(y)
        done = lora_rows(x, y, A_Lri, B_Lor, lane_N, order_N, scale_L, checked=shape)
        assert done, "the caller checks lora_rows_trains"
        ctx.save_for_backward(x, A_Lri, B_Lor, W, lane_N, order_N, scale_L)
        ctx.rows = shape[:2]
        return y

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        x, A_Lri, B_Lor, W, lane_N, order_N, scale_L = ctx.saved_tensors
        need_x, need_A, need_B, need_y = ctx.needs_input_grad[:4]
        g = grads[0].contiguous()
        # With the base layer: its input gradient first, the kernel adds the update's.
        base_x = None if W is None or not need_x else mixed_matmul(g.view(-1, g.shape[-1]), W)
        out = lora_rows_backward(
            x,
            g,
            A_Lri,
            B_Lor,
            lane_N,
            order_N,
            scale_L,
            ctx.rows,
            g_x=None if base_x is None else base_x.view(x.shape),
            need_x=need_x,
        )
        g_x: Tensor | None
        if out is None:  # the kernels were switched off since the forward: torch's way
            lora_x, g_A, g_B = _rows_backward(x, g, A_Lri, B_Lor, lane_N, scale_L, ctx.rows)
            g_x = lora_x if base_x is None else base_x.view(x.shape) + lora_x
        else:
            g_x, g_A, g_B = out
        return (
            g_x if need_x else None,
            g_A if need_A else None,
            g_B if need_B else None,
            g if need_y else None,
            *(None,) * 7,
        )


def _rows_backward(
    x: Tensor,
    g: Tensor,
    A_Lri: Tensor,
    B_Lor: Tensor,
    lane_N: Tensor,
    scale_L: Tensor | None,
    rows: tuple[int, int],
) -> tuple[Tensor, Tensor, Tensor]:
    """`RowsLoRA`'s gradients of its update in torch's ops (each row's weights gathered)."""
    N, T = rows
    x_NTi, g_NTo = x.reshape(N, T, -1), g.reshape(N, T, -1)
    A_Nri, B_Nor = A_Lri.index_select(0, lane_N), B_Lor.index_select(0, lane_N)
    scale_N = torch.ones(N, dtype=x.dtype) if scale_L is None else scale_L[lane_N]
    h_NTr = torch.bmm(x_NTi, A_Nri.transpose(1, 2)) * scale_N[:, None, None]
    e_NTr = torch.bmm(g_NTo, B_Nor) * scale_N[:, None, None]
    g_x = torch.bmm(e_NTr, A_Nri).reshape(x.shape)
    g_A = torch.zeros_like(A_Lri).index_add_(0, lane_N, torch.bmm(e_NTr.transpose(1, 2), x_NTi))
    g_B = torch.zeros_like(B_Lor).index_add_(0, lane_N, torch.bmm(g_NTo.transpose(1, 2), h_NTr))
    return g_x, g_A, g_B
