"""The per-row LoRA kernel's wrapper (`lora_rows.c`; see `marlaas.model.kernels`)."""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from marlaas.model.kernels.build import kernel as load

if TYPE_CHECKING:  # (lane_layers imports the kernels)
    from marlaas.model.lane_layers import LaneGrads

#: The largest rank `lora_rows` takes (its per-token buffer in `lora_rows.c`).
LORA_ROWS_MAX_RANK = 64


#: A `lora_rows` call's `(N, T, in, out, r)`, as `_shape` finds it.
Shape = tuple[int, int, int, int, int]


def lora_rows(
    x_NTi: Tensor,
    y_NTo: Tensor,
    A_Lri: Tensor,
    B_Lor: Tensor,
    lane_N: Tensor,
    order_N: Tensor,
    scale_L: Tensor | None,
    rows: tuple[int, int] | None = None,
    checked: Shape | None = None,
) -> bool:
    """Add `scale_L[l] * (x A_L[l]^T) B_L[l]^T` to the `T` tokens of every row `n` of
    `y_NTo [N, T, out]`, `l = lane_N[n]`, in place; False (nothing written) where the
    kernel does not apply (see the module doc). `order_N` is the rows sorted by lane
    (any order is exact; sorted, each lane's `B` is prepared once); `scale_L` None: the
    weights carry their scales. `x_NTi` and `y_NTo` must be contiguous, `B_Lor` either
    contiguous along `r` (PEFT's layout) or along `out` (rank-major, read in place),
    `lane_N` and `order_N` contiguous int64 with lanes in `[0, L)`; ranks up to
    `LORA_ROWS_MAX_RANK`. `rows = (N, T)`: `x` and `y` have any leading shape of `N * T`
    tokens, row-major (no view to make: each is an op the device thread pays for).
    `checked`: the shape `lora_rows_trains` returned for these tensors (not checked
    again)."""
    kernel = load("lora_rows")
    shape = checked or _shape(x_NTi, y_NTo, A_Lri, B_Lor, lane_N, order_N, scale_L, rows)
    if kernel is None or shape is None:
        return False
    _, _, _, fan_out, r = shape
    # B rank-major (`out` contiguous, the adapter bank's layout) is read in place, with
    # no scratch (a per-call allocation fewer on the engine's path).
    scratch = None if B_Lor.stride(1) == 1 else torch.empty(r * fan_out, dtype=torch.float32)
    kernel(
        *shape,
        x_NTi.data_ptr(),
        y_NTo.data_ptr(),
        *_lane_args(A_Lri, B_Lor, lane_N, order_N, scale_L),
        0 if scratch is None else scratch.data_ptr(),
    )
    return True


def lora_rows_trains(
    x_NTi: Tensor,
    y_NTo: Tensor | None,
    A_Lri: Tensor,
    B_Lor: Tensor,
    lane_N: Tensor,
    order_N: Tensor,
    scale_L: Tensor | None,
    rows: tuple[int, int] | None = None,
) -> Shape | None:
    """The call's shape where `lora_rows` and `lora_rows_backward` both take these
    tensors, else None (`y_NTo` None: an output yet to be made, contiguous float32 on the
    CPU, of `B_Lor`'s output features)."""
    if load("lora_rows") is None or load("lora_rows_backward") is None:
        return None
    return _shape(x_NTi, y_NTo, A_Lri, B_Lor, lane_N, order_N, scale_L, rows)


def lora_rows_backward(
    x_NTi: Tensor,
    g_NTo: Tensor,
    A_Lri: Tensor,
    B_Lor: Tensor,
    lane_N: Tensor,
    order_N: Tensor,
    scale_L: Tensor | None,
    rows: tuple[int, int] | None = None,
    g_x: Tensor | None = None,
    need_x: bool = True,
) -> tuple[Tensor | None, Tensor, Tensor] | None:
    """The gradients of `lora_rows`' update for the gradient `g_NTo` of its output (laid
    out as `y_NTo`): of `x_NTi` (its shape; added into `g_x` where given, a contiguous
    tensor of that shape; None without `need_x`), of `A_Lri` and of `B_Lor` (`[L, out,
    r]`, rank-major in memory); None where the kernel does not apply (the arguments as
    `lora_rows`'; `g_NTo` contiguous)."""
    kernel = load("lora_rows_backward")
    shape = _shape(x_NTi, g_NTo, A_Lri, B_Lor, lane_N, order_N, scale_L, rows)
    if kernel is None or shape is None:
        return None
    _, _, fan_in, fan_out, r = shape
    L = int(A_Lri.shape[0])
    add = g_x is not None
    if g_x is not None and not (
        g_x.is_contiguous() and g_x.dtype == torch.float32 and g_x.numel() == x_NTi.numel()
    ):
        raise ValueError("g_x must be a contiguous float32 tensor of x's size")
    if g_x is None and need_x:
        g_x = torch.empty_like(x_NTi)
    g_A = torch.zeros((L, r, fan_in), dtype=torch.float32)
    g_Bt = torch.zeros((L, r, fan_out), dtype=torch.float32)
    scratch = None if B_Lor.stride(1) == 1 else torch.empty(r * fan_out, dtype=torch.float32)
    kernel(
        *shape,
        x_NTi.data_ptr(),
        g_NTo.data_ptr(),
        0 if g_x is None else g_x.data_ptr(),
        *_lane_args(A_Lri, B_Lor, lane_N, order_N, scale_L),
        g_A.data_ptr(),
        g_Bt.data_ptr(),
        0 if scratch is None else scratch.data_ptr(),
        int(add),
    )
    return g_x, g_A, g_Bt.transpose(1, 2)


def _lane_args(
    A_Lri: Tensor, B_Lor: Tensor, lane_N: Tensor, order_N: Tensor, scale_L: Tensor | None
) -> tuple[int, ...]:
    """The weights' and lanes' arguments of both kernels, in their C order."""
    return (
        A_Lri.data_ptr(),
        A_Lri.stride(0),
        A_Lri.stride(1),
        B_Lor.data_ptr(),
        B_Lor.stride(0),
        B_Lor.stride(1),
        B_Lor.stride(2),
        lane_N.data_ptr(),
        order_N.data_ptr(),
        0 if scale_L is None else scale_L.data_ptr(),
    )


def lane_weights_take(A_Lri: Tensor, B_Lor: Tensor, fan_in: int, fan_out: int) -> bool:
    """Whether the per-row kernels take these lane weights of a `fan_in -> fan_out`
    module: float32 on the CPU, `A [L, r, in]` with `in` contiguous, `B [L, out, r]`
    contiguous along `r` or `out`, `r` at most `LORA_ROWS_MAX_RANK`."""
    if A_Lri.dim() != 3:
        return False
    L, r = int(A_Lri.shape[0]), int(A_Lri.shape[1])
    return (
        A_Lri.is_cpu
        and B_Lor.is_cpu
        and A_Lri.dtype == B_Lor.dtype == torch.float32
        and int(A_Lri.shape[2]) == fan_in
        and tuple(B_Lor.shape) == (L, fan_out, r)
        and r <= LORA_ROWS_MAX_RANK
        and A_Lri.stride(-1) == 1
        and 1 in (B_Lor.stride(1), B_Lor.stride(2))
    )


def _shape(
    x_NTi: Tensor,
    y_NTo: Tensor | None,
    A_Lri: Tensor,
    B_Lor: Tensor,
    lane_N: Tensor,
    order_N: Tensor,
    scale_L: Tensor | None,
    rows: tuple[int, int] | None,
) -> Shape | None:
    """`(N, T, in, out, r)` of a `lora_rows` call, or None where the kernel does not take
    its tensors (see `lora_rows`; `y_NTo` None: an output the caller makes to fit)."""
    r = int(A_Lri.shape[1])
    fan_in, fan_out = int(x_NTi.shape[-1]), int(B_Lor.shape[1])
    if rows is None:
        N, T = int(x_NTi.shape[0]), int(x_NTi.shape[1])
        shaped = x_NTi.dim() == 3 and (y_NTo is None or tuple(y_NTo.shape[:2]) == (N, T))
    else:
        N, T = rows
        shaped = x_NTi.numel() == N * T * fan_in
    if y_NTo is not None:
        shaped = (
            shaped
            and int(y_NTo.shape[-1]) == fan_out
            and y_NTo.numel() == N * T * fan_out
            and y_NTo.is_cpu
            and y_NTo.dtype == torch.float32
            and y_NTo.is_contiguous()
        )
    if (
        not shaped
        or not (x_NTi.is_cpu and x_NTi.dtype == torch.float32 and x_NTi.is_contiguous())
        or not lane_weights_take(A_Lri, B_Lor, fan_in, fan_out)
        or lane_N.dtype != torch.int64
        or not (lane_N.is_contiguous() and order_N.is_contiguous())
        or (scale_L is not None and (scale_L.dtype != torch.float32 or not scale_L.is_contiguous()))
    ):
        return None
    return N, T, fan_in, fan_out, r


def gather_grads(modules: Sequence[tuple[LaneGrads | None, int, int, int]], dst_LP: Tensor) -> bool:
    """Lay out lanes' gradients as their flat vectors, one row of `dst_LP` per lane: per
    module, in order, `(grads, r, in, out)` (`LaneGrads`: the per-row kernels' layouts,
    contiguous; None: zeros, as for its fresh lanes), each lane's A part then its B part
    in PEFT's layout `[out, r]`; False (nothing written) where the kernel does not take
    them (float32 CPU tensors, `dst_LP` rows dense, each exactly as wide as the parts)."""
    kernel = load("lora_gather_grads")
    L = int(dst_LP.shape[0])
    parts = [t for grads, *_ in modules if grads is not None for t in (grads.gA, grads.gBt)]
    if (
        kernel is None
        or dst_LP.dim() != 2
        or dst_LP.dtype != torch.float32
        or dst_LP.device.type != "cpu"
        or dst_LP.stride(1) != 1
        or int(dst_LP.shape[1]) != sum(r * (i + o) for _, r, i, o in modules)
        or any(
            t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous()
            for t in parts
        )
        or any(
            grads is not None
            and (
                tuple(grads.gA.shape) != (L, r, i)
                or tuple(grads.gBt.shape) != (L, r, o)
                or tuple(grads.fresh_L.shape) != (L,)
                or grads.fresh_L.dtype != torch.uint8
                or not grads.fresh_L.is_contiguous()
            )
            for grads, r, i, o in modules
        )
    ):
        return False
    fields = array.array("q")
    for grads, r, i, o in modules:
        if grads is None:
            fields.extend((0, r, i, 0, o, 0))
        else:
            fields.extend(
                (grads.gA.data_ptr(), r, i, grads.gBt.data_ptr(), o, grads.fresh_L.data_ptr())
            )
    kernel(len(modules), fields.buffer_info()[0], L, dst_LP.data_ptr(), dst_LP.stride(0))
    return True
