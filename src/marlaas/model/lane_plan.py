"""How one lane batch applies its adapters: the rows as blocks or as segments.

`LanePlan.of` looks at the lane of every row (on the host, once per `lanes()` context)
and picks the cheapest exact layout for `marlaas.model.lora.MultiLoRALinear`:

- blocks: consecutive rows that share a lane, `size` rows each (the greatest common
  divisor of the runs of equal lanes), so each block is a view of the rows and one
  batched matmul per block applies its lane's weights; a trainer micro-batch (rows
  grouped by tenant) is one block per tenant, straight on the stacked weights;
- segments (`Segments`): rows of interleaved lanes and few tokens each (a decode
  batch) are gathered into one padded piece per lane (Punica's and S-LoRA's segments),
  two dense matmuls per piece, and scattered back: a copy of each row's activations
  instead of a copy of its lane's weights.

Without gradients on the CPU (the engine), rows that each have their own lane skip
both layouts: the native kernel `marlaas.model.kernels.lora_rows` adds every row's
update in place, reading its lane's weights where they lie (`RowLanes`); where it does
not apply (another device or dtype, no compiler) the segments or per-row blocks run.

All give every row exactly `scale[lane] * (x A[lane]^T) B[lane]^T`, gradients
included; `scale` is skipped when the weights carry it (`LaneBatch.prescaled`).

Runs (a packed micro-batch, `marlaas.train.decoder.Packed`: a token a row, each lane's
tokens one run of its own length): on the CPU the native kernels take every row where
its lane's weights lie, forward and backward (`RowsLoRA`; with the base layer as one node,
`LinearRowsLoRA`, whose input gradient the kernel adds into the base's: `bench trainer`'s
32 tenants 123-126 -> 118-121 ms a forward/backward); elsewhere each run is cut into
pieces of one size (`Segments.of_runs`).

With gradients on (the trainer), blocks run through `BlockLoRA`, one autograd node per
module with a hand-written backward: autograd's own backward of the same ops picks
batched-matmul layouts that are several times slower at LoRA's shapes (a rank-wide
inner or outer dimension) and sums per-row weight gradients through a strided scatter.
The decode path (no gradient) is unchanged.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from marlaas.model.kernels import (
    lora_rows,
    lora_rows_backward,
    lora_rows_trains,
    native_kernels,
)

#: What one more piece costs in rows of padding, when `Segments.of_runs` sizes them.
PIECE_ROWS = 16
#: Blocks of fewer tokens than this, with several blocks to a lane, run as segments.
MIN_BLOCK_TOKENS = 16
#: Lane batches of more rows than this find their runs in one torch op, not in Python.
RUNS_ON_DEVICE = 256


@dataclass(frozen=True)
class Segments:
    """Rows regrouped by lane into `pieces` padded pieces of `size` rows (Punica's and
    S-LoRA's segments): row `gather[k * size + i]` is row `i` of piece `k` (padding
    repeats a row; its result is dropped), and row `b`'s result is at `inverse[b]` of
    the padded layout.

    Each module gathers its own input: the modules that read the same one (`q_proj`,
    `k_proj`, `v_proj`; `gate_proj`, `up_proj`) cannot prove it unwritten since in the
    engine's inference mode (no version counter), and keeping a gather measured no
    faster at 256 rows.
    """

    pieces: int
    size: int
    gather: Tensor
    inverse: Tensor

    @staticmethod
    def of(
        lanes_B: list[int], num_lanes: int, device: torch.device
    ) -> tuple[Segments, list[int] | None]:
        """The segments of a batch, and the lane of each piece (None: piece `k` is lane
        `k`, every lane in order, so the stacked weights are used without a gather)."""
        rows_of: dict[int, list[int]] = {}
        for b, lane in enumerate(lanes_B):
            rows_of.setdefault(lane, []).append(b)
        B, biggest = len(lanes_B), max(len(rows) for rows in rows_of.values())
        # Empty lanes pad less than a weight gather costs while the padded rows stay few.
        every_lane = num_lanes * biggest <= max(2 * B, 128)
        size = biggest
        if not every_lane and size * len(rows_of) > 2 * B:
            # A few crowded lanes would pad the others too much: pieces of the mean size.
            size = -(-B // len(rows_of))
        gather: list[int] = []
        lane_P: list[int] = []
        inverse = [0] * B
        for lane in range(num_lanes) if every_lane else sorted(rows_of):
            rows = rows_of.get(lane, [0])  # an empty lane pads with row 0 (dropped)
            for start in range(0, len(rows), size):
                chunk = rows[start : start + size]
                if lane in rows_of:
                    for i, b in enumerate(chunk):
                        inverse[b] = len(gather) + i
                gather += chunk + [chunk[0]] * (size - len(chunk))
                lane_P.append(lane)
        segments = Segments(
            pieces=len(lane_P),
            size=size,
            gather=torch.tensor(gather, dtype=torch.long, device=device),
            inverse=torch.tensor(inverse, dtype=torch.long, device=device),
        )
        return segments, None if every_lane else lane_P

    @staticmethod
    def of_runs(runs: list[tuple[int, int]], device: torch.device) -> tuple[Segments, list[int]]:
        """The segments of rows that come as `runs` of `(lane, rows)`, each lane's rows
        one run (a packed micro-batch: every token a row): each run cut into pieces of
        one size, chosen among powers of two up to the longest run for the fewest padded
        rows plus `PIECE_ROWS` per piece (a piece's fixed cost); the lane of each piece."""
        longest = max(count for _, count in runs)
        best: tuple[int, int] | None = None
        size = 1
        while True:
            size = min(2 * size, longest)
            pieces = sum(-(-count // size) for _, count in runs)
            cost = pieces * (size + PIECE_ROWS)
            if best is None or cost < best[0]:
                best = (cost, size)
            if size == longest:
                break
        size = best[1]
        # Pieces in run order: piece p of run r covers rows [start, end) of it, padded by
        # repeating its first row; `inverse` maps each row to its place in the layout.
        lane_R = torch.tensor([lane for lane, _ in runs], dtype=torch.long)
        count_R = torch.tensor([count for _, count in runs], dtype=torch.long)
        first_R = count_R.cumsum(0) - count_R
        pieces_R = (count_R + size - 1) // size
        run_P = torch.repeat_interleave(torch.arange(len(runs)), pieces_R)
        k_P = torch.arange(int(pieces_R.sum())) - (pieces_R.cumsum(0) - pieces_R)[run_P]
        start_P = first_R[run_P] + k_P * size
        end_P = torch.minimum(start_P + size, (first_R + count_R)[run_P])
        index_PS = start_P[:, None] + torch.arange(size)
        valid_PS = index_PS < end_P[:, None]
        gather = torch.where(valid_PS, index_PS, start_P[:, None]).reshape(-1)
        inverse = torch.empty(int(count_R.sum()), dtype=torch.long)
        inverse[index_PS[valid_PS]] = valid_PS.reshape(-1).nonzero().squeeze(1)
        lane_P: list[int] = lane_R[run_P].tolist()
        segments = Segments(
            pieces=len(lane_P),
            size=size,
            gather=gather.to(device),
            inverse=inverse.to(device),
        )
        return segments, lane_P

    def gathered(self, x_BD: Tensor) -> Tensor:
        """`x_BD`'s rows in the padded layout."""
        return x_BD.index_select(0, self.gather)


@dataclass(frozen=True)
class RowLanes:
    """Rows that each use their own lane, for the native kernel: the lane of every row,
    the rows sorted by lane (each lane's weights are then prepared once) and the
    per-lane scales (None: the weights carry them)."""

    lane_N: Tensor
    order_N: Tensor
    scale_L: Tensor | None
    #: The kernels run with gradients too (`RowsLoRA`), not only without.
    trains: bool = False

    @staticmethod
    def of(lane_B: Tensor, scale_L: Tensor | None, trains: bool = False) -> RowLanes | None:
        """None where the kernel never applies: off the CPU, or not built."""
        if lane_B.device.type != "cpu" or not native_kernels("lora_rows"):
            return None
        lane_N = lane_B.to(torch.long).contiguous()
        return RowLanes(
            lane_N=lane_N,
            order_N=torch.argsort(lane_N, stable=True),
            scale_L=scale_L,
            trains=trains,
        )


@dataclass(frozen=True)
class LanePlan:
    """How one lane batch applies its adapters, made once per `lanes()` context.

    Blocks (`segments` None): the rows seen as `blocks` consecutive blocks of `size`
    rows, one lane each; `size` is the greatest common divisor of the lengths of the
    runs of equal lanes in `lane_B`, so the blocks are views of the rows in place (no
    copy, no padding): the trainer's micro-batches (rows grouped by tenant) become one
    block per tenant. Block `k` uses lane `lane_K[k]` (None: block `k` is lane `k`, so
    the stacked weights are used as they are, no gather) with scale `scale_K[k]`.

    Segments: when no two neighbouring rows share a lane (a decode batch of many
    tenants) and rows are short, the rows are gathered into per-lane pieces
    (`Segments`) and each piece runs two dense matmuls on its lane's weights: a few
    small copies of activations instead of a copy of the weights for every row.
    `lane_K`/`scale_K` are then per piece.

    `rows` (both cases of one row per block): what the native kernel needs to skip
    either layout when no gradient is wanted (see the module doc).
    """

    size: int
    blocks: int
    lane_K: Tensor | None
    #: Per block or piece; None when the weights carry the scales (`LaneBatch.prescaled`).
    scale_K: Tensor | None
    segments: Segments | None = None
    rows: RowLanes | None = None

    @staticmethod
    def of(
        lane_B: Tensor,
        num_lanes: int,
        scale_L: Tensor | None,
        scale_B: Tensor,
        tokens: int,
        rank: int,
    ) -> LanePlan:
        """The plan of a lane batch for rows of `tokens` tokens and adapters of `rank`
        (`scale_L` None: the weights carry the scales), made on the host (reading
        `lane_B` is one device sync per forward when it lives on an accelerator)."""
        B = int(lane_B.shape[0])
        if B > RUNS_ON_DEVICE:  # a packed micro-batch's tokens: its runs, not its rows
            lanes_R, counts_R = torch.unique_consecutive(lane_B, return_counts=True)
            runs = list(zip(lanes_R.tolist(), counts_R.tolist(), strict=True))
        else:
            runs = [(lane, sum(1 for _ in run)) for lane, run in itertools.groupby(lane_B.tolist())]
        size = math.gcd(*(count for _, count in runs)) if runs else 1
        blocks = sum(count // size for _, count in runs)

        def scales(index: Tensor | None) -> Tensor | None:
            if scale_L is None:
                return None
            return scale_L if index is None else scale_L[index]

        if blocks == num_lanes and all(
            count == size and lane == k for k, (lane, count) in enumerate(runs)
        ):  # one block per lane, in lane order
            return LanePlan(size, blocks, None, scales(None))
        if size * tokens < MIN_BLOCK_TOKENS and blocks > 2 * len(runs):
            # Long runs of short rows (a packed micro-batch, a token a row): a weight copy
            # per block of a few rows would cost more than the rows themselves. The native
            # kernels take every row where its weights lie, forward and backward; torch's
            # way is segments per run.
            distinct = len({lane for lane, _ in runs}) == len(runs)
            if distinct and len(runs) < B:
                rows = RowLanes.of(lane_B, scale_L, trains=True)
                segments, run_lanes = Segments.of_runs(runs, lane_B.device)
                lane_P = torch.tensor(run_lanes, dtype=torch.long, device=lane_B.device)
                return LanePlan(1, segments.pieces, lane_P, scales(lane_P), segments, rows)
        lanes_B: list[int] = lane_B.tolist()
        lanes_K = [lane for lane, count in runs for _ in range(count // size)]
        rows = RowLanes.of(lane_B, scale_L) if size == 1 else None
        if size == 1 and 2 * tokens < rank:
            # Per-row blocks would copy every row's weights (rank x features each); the
            # segments copy each row's activations twice (tokens x features).
            segments, lanes_P = Segments.of(lanes_B, num_lanes, lane_B.device)
            if lanes_P is None:
                return LanePlan(1, segments.pieces, None, scales(None), segments, rows)
            lane_P = torch.tensor(lanes_P, dtype=torch.long, device=lane_B.device)
            return LanePlan(1, segments.pieces, lane_P, scales(lane_P), segments, rows)
        if size == 1:
            scale_K = None if scale_L is None else scale_B
            return LanePlan(1, len(lanes_B), lane_B, scale_K, rows=rows)
        lane_K = torch.tensor(lanes_K, dtype=torch.long, device=lane_B.device)
        return LanePlan(size, len(lanes_K), lane_K, scales(lane_K))

    def apply(
        self,
        x: Tensor,
        A_Lri: Tensor,
        B_Lor: Tensor,
        y: Tensor,
        rows: int | None = None,
        tokens: int | None = None,
    ) -> Tensor:
        """`y` plus the LoRA update of `x`, both holding `rows` rows of `tokens` tokens in
        any leading shape (default `[rows, tokens, features]`); without gradients, where
        the native kernel applies, written into `y` itself on the tensors as they come (no
        view made: each is an op the device thread pays for)."""
        if rows is None or tokens is None:
            rows, tokens = int(x.shape[0]), int(x.shape[1])
        grad = torch.is_grad_enabled() and (
            A_Lri.requires_grad or B_Lor.requires_grad or x.requires_grad
        )
        plan = self.rows
        if plan is not None and not grad:
            if lora_rows(
                x, y, A_Lri, B_Lor, plan.lane_N, plan.order_N, plan.scale_L, rows=(rows, tokens)
            ):
                return y
        elif (
            plan is not None
            and plan.trains
            and x.is_contiguous()
            and lora_rows_trains(
                x, y, A_Lri, B_Lor, plan.lane_N, plan.order_N, plan.scale_L, rows=(rows, tokens)
            )
        ):
            out = RowsLoRA.apply(x, A_Lri, B_Lor, y, plan, (rows, tokens))
            assert isinstance(out, Tensor)
            return out
        x_BTi, y_BTo = _as_rows(x, rows, tokens), _as_rows(y, rows, tokens)
        out = self._apply_torch(x_BTi, A_Lri, B_Lor, y_BTo, grad)
        if out is y_BTo:  # in place: y is the result
            return y
        return out if y_BTo is y else out.reshape(y.shape)

    def linear(
        self,
        x: Tensor,
        W: Tensor,
        b: Tensor | None,
        A_Lri: Tensor,
        B_Lor: Tensor,
        rows: int,
        tokens: int,
    ) -> Tensor | None:
        """`F.linear(x, W, b)` plus the LoRA update as one autograd node
        (`LinearRowsLoRA`) where that applies: a trainer's packed forward with gradients,
        the native kernels, a frozen float32 base weight; else None (the caller runs the
        base layer and `apply`)."""
        plan = self.rows
        if (
            plan is None
            or not plan.trains
            or not torch.is_grad_enabled()
            or W.requires_grad
            or (b is not None and b.requires_grad)
            or W.dtype != x.dtype
            or not x.is_contiguous()
            or not (x.requires_grad or A_Lri.requires_grad or B_Lor.requires_grad)
            or not lora_rows_trains(
                x, None, A_Lri, B_Lor, plan.lane_N, plan.order_N, plan.scale_L, (rows, tokens)
            )
        ):
            return None
        out = LinearRowsLoRA.apply(x, W, b, A_Lri, B_Lor, plan, (rows, tokens))
        assert isinstance(out, Tensor)
        return out

    def _apply_torch(
        self, x_BTi: Tensor, A_Lri: Tensor, B_Lor: Tensor, y_BTo: Tensor, grad: bool
    ) -> Tensor:
        """`apply` in torch's ops, on `[B, T, features]` rows."""
        if self.segments is not None:
            return self._apply_segments(self.segments, x_BTi, A_Lri, B_Lor, y_BTo)
        K, n = self.blocks, self.size
        # Blocks of one row are the rows themselves: no reshapes (decode is op-bound).
        x_Kni = x_BTi if n == 1 else x_BTi.reshape(K, -1, x_BTi.shape[-1])
        if grad and x_BTi.dtype == A_Lri.dtype == B_Lor.dtype == y_BTo.dtype:
            y_Kno = y_BTo if n == 1 else y_BTo.reshape(K, -1, y_BTo.shape[-1])
            scale_K = None if self.scale_K is None else self.scale_K.to(x_BTi.dtype)
            out = BlockLoRA.apply(x_Kni, A_Lri, B_Lor, y_Kno, self.lane_K, scale_K)
            assert isinstance(out, Tensor)
            return out if n == 1 else out.reshape(y_BTo.shape)
        if self.lane_K is None:
            A_Kri, B_Kor = A_Lri, B_Lor
        else:  # index_select (not fancy indexing): about 2x faster on strided slot views
            A_Kri, B_Kor = A_Lri.index_select(0, self.lane_K), B_Lor.index_select(0, self.lane_K)
        h_Knr = torch.bmm(x_Kni, A_Kri.transpose(1, 2))
        if self.scale_K is not None:
            h_Knr = h_Knr * self.scale_K.to(h_Knr.dtype)[:, None, None]
        if y_BTo.dtype != h_Knr.dtype:  # e.g. float32 adapters on a bfloat16 base
            delta_Kno = torch.bmm(h_Knr, B_Kor.transpose(1, 2))
            return y_BTo + delta_Kno.reshape(y_BTo.shape).to(y_BTo.dtype)
        y_Kno = y_BTo if n == 1 else y_BTo.reshape(K, -1, y_BTo.shape[-1])
        out_Kno = torch.baddbmm(y_Kno, h_Knr, B_Kor.transpose(1, 2))  # the add in the matmul
        return out_Kno if n == 1 else out_Kno.reshape(y_BTo.shape)

    def _apply_segments(
        self, seg: Segments, x_BTi: Tensor, A_Lri: Tensor, B_Lor: Tensor, y_BTo: Tensor
    ) -> Tensor:
        B, T, fan_in = x_BTi.shape
        x_Pni = seg.gathered(x_BTi.reshape(B, T * fan_in)).view(seg.pieces, -1, fan_in)
        if torch.is_grad_enabled() and x_Pni.dtype == A_Lri.dtype == B_Lor.dtype:
            scale_P = None if self.scale_K is None else self.scale_K.to(x_Pni.dtype)
            delta_Pno = BlockLoRA.apply(x_Pni, A_Lri, B_Lor, None, self.lane_K, scale_P)
            assert isinstance(delta_Pno, Tensor)
            delta_BTo = delta_Pno.reshape(seg.pieces * seg.size, -1).index_select(0, seg.inverse)
            return y_BTo + delta_BTo.view(y_BTo.shape).to(y_BTo.dtype)
        if self.lane_K is None:
            A_Pri, B_Por = A_Lri, B_Lor
        else:
            A_Pri, B_Por = A_Lri.index_select(0, self.lane_K), B_Lor.index_select(0, self.lane_K)
        h_Pnr = torch.bmm(x_Pni, A_Pri.transpose(1, 2))
        if self.scale_K is not None:
            h_Pnr = h_Pnr * self.scale_K.to(h_Pnr.dtype)[:, None, None]
        delta_Pno = torch.bmm(h_Pnr, B_Por.transpose(1, 2))
        delta_BTo = delta_Pno.reshape(seg.pieces * seg.size, -1).index_select(0, seg.inverse)
        return y_BTo + delta_BTo.view(y_BTo.shape).to(y_BTo.dtype)


def _as_rows(t: Tensor, rows: int, tokens: int) -> Tensor:
    """`t` seen as `[rows, tokens, features]` (itself where it already is)."""
    return t if t.shape[:-1] == (rows, tokens) else t.reshape(rows, tokens, t.shape[-1])


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
    """`y + scale * (x A^T) B^T` with each row's own lane, through the native kernels
    both ways (`lora_rows`, `lora_rows_backward`): no gather of the rows into per-lane
    pieces and no copy of the weights per row, so a packed micro-batch (each token a
    row, its tenant's tokens one run) costs its tokens' products alone. `y` is added
    into in place; the caller checks the kernels take the tensors
    (`lora_rows_trains`)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        A_Lri: Tensor,
        B_Lor: Tensor,
        y: Tensor,
        plan: RowLanes,
        rows: tuple[int, int],
    ) -> Tensor:
        if y._base is not None:  # a view (F.linear's with a bias): autograd needs a copy
            y = y.clone()
        else:
            ctx.mark_dirty(y)
        done = lora_rows(x, y, A_Lri, B_Lor, plan.lane_N, plan.order_N, plan.scale_L, rows=rows)
        assert done, "the caller checks lora_rows_trains"
        ctx.save_for_backward(x, A_Lri, B_Lor)
        ctx.plan, ctx.rows = plan, rows
        return y

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        (g,) = grads
        x, A_Lri, B_Lor = ctx.saved_tensors
        plan: RowLanes = ctx.plan
        need_x, need_A, need_B = ctx.needs_input_grad[:3]
        out = lora_rows_backward(
            x,
            g.contiguous(),
            A_Lri,
            B_Lor,
            plan.lane_N,
            plan.order_N,
            plan.scale_L,
            ctx.rows,
            need_x=need_x,
        )
        if out is None:  # the kernels were switched off since the forward: torch's way
            out = _rows_backward(x, g, A_Lri, B_Lor, plan, ctx.rows)
        g_x, g_A, g_B = out
        return (
            g_x if need_x else None,
            g_A if need_A else None,
            g_B if need_B else None,
            g,
            None,
            None,
        )


class LinearRowsLoRA(torch.autograd.Function):
    """`F.linear(x, W, b)` plus `RowsLoRA`'s update, as one node: the backward's input
    gradient is the base's `g W` with the LoRA part added into it by the kernel, not two
    tensors autograd then sums (a pass over every linear layer's input gradient fewer,
    and a node fewer per layer). The base weight and bias are frozen (no gradient)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        W: Tensor,
        b: Tensor | None,
        A_Lri: Tensor,
        B_Lor: Tensor,
        plan: RowLanes,
        rows: tuple[int, int],
    ) -> Tensor:
        y = F.linear(x, W, b).contiguous()
        done = lora_rows(x, y, A_Lri, B_Lor, plan.lane_N, plan.order_N, plan.scale_L, rows=rows)
        assert done, "the caller checks lora_rows_trains"
        ctx.save_for_backward(x, W, A_Lri, B_Lor)
        ctx.plan, ctx.rows = plan, rows
        return y

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        (g,) = grads
        x, W, A_Lri, B_Lor = ctx.saved_tensors
        plan: RowLanes = ctx.plan
        need_x, _, _, need_A, need_B = ctx.needs_input_grad[:5]
        g = g.contiguous()
        g_x = torch.mm(g.view(-1, g.shape[-1]), W).view(x.shape) if need_x else None
        out = lora_rows_backward(
            x,
            g,
            A_Lri,
            B_Lor,
            plan.lane_N,
            plan.order_N,
            plan.scale_L,
            ctx.rows,
            g_x=g_x,
            need_x=need_x,
        )
        if out is None:  # the kernels were switched off since the forward: torch's way
            lora_x, g_A, g_B = _rows_backward(x, g, A_Lri, B_Lor, plan, ctx.rows)
            if g_x is not None:
                g_x = g_x + lora_x
        else:
            _, g_A, g_B = out
        return (
            g_x,
            None,
            None,
            g_A if need_A else None,
            g_B if need_B else None,
            None,
            None,
        )


def _rows_backward(
    x: Tensor, g: Tensor, A_Lri: Tensor, B_Lor: Tensor, plan: RowLanes, rows: tuple[int, int]
) -> tuple[Tensor, Tensor, Tensor]:
    """`RowsLoRA`'s gradients in torch's ops (each row's weights gathered)."""
    N, T = rows
    x_NTi, g_NTo = x.reshape(N, T, -1), g.reshape(N, T, -1)
    A_Nri, B_Nor = A_Lri.index_select(0, plan.lane_N), B_Lor.index_select(0, plan.lane_N)
    scale_N = (torch.ones(N, dtype=x.dtype) if plan.scale_L is None else plan.scale_L[plan.lane_N])[
        :, None, None
    ]
    h_NTr = torch.bmm(x_NTi, A_Nri.transpose(1, 2)) * scale_N
    e_NTr = torch.bmm(g_NTo, B_Nor) * scale_N
    g_x = torch.bmm(e_NTr, A_Nri).reshape(x.shape)
    L = A_Lri.shape[0]
    g_A = A_Lri.new_zeros(A_Lri.shape).index_add_(
        0, plan.lane_N, torch.bmm(e_NTr.transpose(1, 2), x_NTi)
    )
    g_B = B_Lor.new_zeros((L, *B_Lor.shape[1:])).index_add_(
        0, plan.lane_N, torch.bmm(g_NTo.transpose(1, 2), h_NTr)
    )
    return g_x, g_A, g_B
