"""How one lane batch applies its adapters: the rows as blocks or as segments.

`LanePlan.of` looks at the lane of every row (on the host, once per `lanes()` context)
and picks the cheapest exact layout for `marlaas.model.lane_layers.MultiLoRALinear`:

- blocks: consecutive rows that share a lane, `size` rows each (the greatest common
  divisor of the runs of equal lanes), so each block is a view of the rows and one
  batched matmul per block applies its lane's weights; a trainer micro-batch (rows
  grouped by tenant) is one block per tenant, straight on the stacked weights;
- segments (`Segments`): rows of interleaved lanes and few tokens each (a decode
  batch) are gathered into one padded piece per lane (Punica's and S-LoRA's segments),
  two dense matmuls per piece, and scattered back: a copy of each row's activations
  instead of a copy of its lane's weights.

Without gradients on the CPU (the engine), rows skip both layouts: the native kernel
`marlaas.model.kernels.lora_rows` adds every row's update in place, reading its lane's
weights where they lie (`RowLanes`), whether each row has its own lane (a decode batch)
or many rows share one (a prefill of one tenant's prompts: through torch's batched
matmuls, rank 8, 16 rows x 64 tokens, 41-58 GFLOP/s against the kernel's 103-157); where
it does not apply (another device or dtype, no compiler) the segments or blocks run.

All give every row exactly `scale[lane] * (x A[lane]^T) B[lane]^T`, gradients
included; `scale` is skipped when the weights carry it (`LaneBatch.prescaled`).

Runs (a packed micro-batch, `marlaas.train.decoder.Packed`: a token a row, each lane's
tokens one run of its own length): on the CPU the native kernels take every row where
its lane's weights lie, forward and backward (`model.lora_grad.RowsLoRA`; with the base
layer in the same node where it is float32, its input gradient one buffer: `bench
trainer`'s 32 tenants 123-126 -> 118-121 ms a forward/backward); elsewhere each run is
cut into pieces of one size (`Segments.of_runs`).

With gradients on (the trainer), blocks run through `model.lora_grad.BlockLoRA`, one autograd node per
module with a hand-written backward: autograd's own backward of the same ops picks
batched-matmul layouts that are several times slower at LoRA's shapes (a rank-wide
inner or outer dimension) and sums per-row weight gradients through a strided scatter.
The decode path (no gradient) is unchanged.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from marlaas.model.kernels import lora_rows, lora_rows_trains, native_kernels
from marlaas.model.lora_grad import BlockLoRA, RowsLoRA
from marlaas.model.mixed import HALF_DTYPES

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

    def rows_lora(
        self,
        x: Tensor,
        A_Lri: Tensor,
        B_Lor: Tensor,
        y: Tensor | None,
        W: Tensor | None,
        b: Tensor | None,
        shape: tuple[int, int, int, int, int],
    ) -> Tensor:
        """`RowsLoRA` over these rows (see there)."""
        out = RowsLoRA.apply(
            x, A_Lri, B_Lor, y, W, b, self.lane_N, self.order_N, self.scale_L, shape
        )
        assert isinstance(out, Tensor)
        return out

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
            return LanePlan(size, blocks, None, scales(None), rows=RowLanes.of(lane_B, scale_L))
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
        rows = RowLanes.of(lane_B, scale_L)
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
        return LanePlan(size, len(lanes_K), lane_K, scales(lane_K), rows=rows)

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
        elif plan is not None and plan.trains:
            shape = lora_rows_trains(
                x, y, A_Lri, B_Lor, plan.lane_N, plan.order_N, plan.scale_L, rows=(rows, tokens)
            )
            if shape is not None:
                return plan.rows_lora(x, A_Lri, B_Lor, y, None, None, shape)
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
        (`RowsLoRA` with the base layer) where that applies: a trainer's packed forward with gradients,
        the native kernels, a frozen base weight in `x`'s dtype or a half one
        (`model.mixed`); else None (the caller runs the base layer and `apply`)."""
        plan = self.rows
        if (
            plan is None
            or not plan.trains
            or not torch.is_grad_enabled()
            or W.requires_grad
            or (b is not None and b.requires_grad)
            or (W.dtype != x.dtype and W.dtype not in HALF_DTYPES)
            or not (x.requires_grad or A_Lri.requires_grad or B_Lor.requires_grad)
        ):
            return None
        shape = lora_rows_trains(
            x, None, A_Lri, B_Lor, plan.lane_N, plan.order_N, plan.scale_L, (rows, tokens)
        )
        return None if shape is None else plan.rows_lora(x, A_Lri, B_Lor, None, W, b, shape)

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
