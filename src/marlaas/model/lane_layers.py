"""The lane batch of a multi-LoRA forward and the layer that applies it
(`marlaas.model.lora` injects the layers and sets the batch: see its module doc).

- `LaneBatch`: adapters stacked along a lane axis and the lane of every row.
- `LaneContext`: the lane batch of the forward in progress, visible only to the thread
  that set it, and its `LanePlan` (`marlaas.model.lane_plan`), made once per batch.
- `MultiLoRALinear`: a frozen base layer plus the current batch's per-row update.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from marlaas.errors import ModelError
from marlaas.model.arch import layer_features
from marlaas.model.lane_plan import LanePlan, RowLanes


@dataclass(frozen=True)
class LaneBatch:
    """Adapters stacked along a lane axis, and the lane of every batch row.

    `A[path]` is `[L, r, in]`, `B[path]` is `[L, out, r]` (one `r` per batch, lanes of a
    lower rank zero-padded), `scale_L` is `[L]` (alpha/r per lane; 0 is the plain base)
    and `lane_B` is `[B]`, the lane of each row. Modules missing from `A`/`B` compute
    the plain base for every row. For packed inputs (all sequences in one row) `lane_B`
    may instead hold one lane per token, `[B * T]` in row-major order.
    """

    lane_B: Tensor
    A: Mapping[str, Tensor]
    B: Mapping[str, Tensor]
    scale_L: Tensor
    #: `B` already holds `scale_L[lane] * B` (the adapter bank's slots): the layers
    #: skip the multiplication by the scale.
    prescaled: bool = False
    #: Where a native backward adds the lanes' gradients of module `path` instead of
    #: handing them to autograd (`LaneGrads`): one set of buffers for all of a trainer
    #: micro-batch's passes, made by the first (`marlaas.train.lanes.MicroLanes` reads
    #: them); None: autograd's, as every other path.
    grads: dict[str, LaneGrads] | None = None

    @property
    def num_lanes(self) -> int:
        return int(self.scale_L.shape[0])


@dataclass(frozen=True)
class LaneGrads:
    """One module's lanes' gradients from a native backward (`LaneBatch.grads`, or a
    pass's own for autograd, `LaneGrads.settled` first): `A`'s
    `[L, r, in]`, `B`'s rank-major `[L, r, out]`, and `fresh_L` (uint8) marking the lanes
    no pass has reached yet, whose rows hold no values: the first pass to reach a lane
    writes its rows and clears its mark, the later ones add (no zeros written first)."""

    gA: Tensor
    gBt: Tensor
    fresh_L: Tensor

    @staticmethod
    def of(A_Lri: Tensor, B_Lor: Tensor) -> LaneGrads:
        """Buffers for module `(A, B)`'s lanes, every lane fresh."""
        L, r = int(A_Lri.shape[0]), int(A_Lri.shape[1])
        return LaneGrads(
            torch.empty((L, r, int(A_Lri.shape[2]))),
            torch.empty((L, r, int(B_Lor.shape[1]))),
            torch.ones(L, dtype=torch.uint8),
        )

    def settled(self) -> tuple[Tensor, Tensor]:
        """`(gA, gBt)` with every lane's rows holding its gradient: a fresh lane's
        zeroed (in place; no pass reached it)."""
        fresh = self.fresh_L.bool()
        if bool(fresh.any()):
            self.gA[fresh] = 0.0
            self.gBt[fresh] = 0.0
            self.fresh_L.zero_()
        return self.gA, self.gBt


class LaneContext:
    """The lane batch of the forward in progress and the thread that set it."""

    def __init__(self) -> None:
        self.batch: LaneBatch | None = None
        self.scale_B: Tensor | None = None
        self.plan: LanePlan | None = None
        self.owner: int | None = None
        #: The last plan of a prescaled batch (the adapter bank's), by the identity and
        #: version of its `lane_B` and its shape: consecutive decode steps of an
        #: unchanged batch (the same slot tensor, never written) reuse it.
        self._last: tuple[Tensor, int, int, int, int, LanePlan] | None = None

    def current(self, tokens: int, rank: int) -> tuple[LaneBatch, LanePlan] | None:
        """The lane batch and its plan (made by the first targeted layer, for its rows of
        `tokens` tokens and the batch's `rank`), or None outside a lane context."""
        if self.owner != threading.get_ident() or self.batch is None or self.scale_B is None:
            return None
        if self.plan is None:
            batch, last = self.batch, self._last
            # An inference tensor has no version counter: its plans are not kept.
            keep = batch.prescaled and not batch.lane_B.is_inference()
            key = (batch.lane_B._version if keep else -1, batch.num_lanes, tokens, rank)
            if keep and last is not None and last[0] is batch.lane_B and last[1:5] == key:
                self.plan = last[5]
            else:
                scale_L = None if batch.prescaled else batch.scale_L
                self.plan = LanePlan.of(
                    batch.lane_B, batch.num_lanes, scale_L, self.scale_B, tokens, rank
                )
                self._last = (batch.lane_B, *key, self.plan) if keep else None
        return self.batch, self.plan

    def row_lanes(self, tokens: int) -> tuple[LaneBatch, RowLanes] | None:
        """The lane batch and its rows for the native kernels (`RowLanes`: each row's
        lane, the rows by lane, the scales), for inputs of `tokens` tokens (a whole
        number a row); None outside a lane context, or where the kernels are not built.
        Made directly, not through the plan, whose other layouts (segments: a Python loop
        over the rows) only torch's path needs."""
        if self.owner != threading.get_ident() or self.batch is None:
            return None
        batch = self.batch
        rows = int(batch.lane_B.shape[0])
        if rows == 0 or tokens % rows:
            return None
        lanes = RowLanes.of(batch.lane_B, None if batch.prescaled else batch.scale_L)
        return None if lanes is None else (batch, lanes)

    def linear(self, path: str, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor | None:
        """`F.linear(x, weight, bias)` plus module `path`'s LoRA update as one autograd node
        where the lane plan has one for it (`LanePlan.linear`); None otherwise (the caller
        runs the base layer, then `add_update`)."""
        if self.owner != threading.get_ident() or self.batch is None:
            return None
        A_Lri = self.batch.A.get(path)
        rows = self.batch.lane_B.shape[0]
        tokens = x.shape[:-1].numel()
        if A_Lri is None or x.dim() < 2 or rows == 0 or tokens % rows:
            return None
        current = self.current(tokens // rows, int(A_Lri.shape[1]))
        assert current is not None
        batch, plan = current
        return plan.linear(x, weight, bias, A_Lri, batch.B[path], rows, tokens // rows)

    def add_update(self, path: str, x: Tensor, y: Tensor) -> Tensor:
        """`y` (the base layer's output for input `x`) plus the LoRA update of module
        `path` under the lane batch this thread set; `y` itself outside a lane context
        or for a module the batch leaves out."""
        if self.owner != threading.get_ident() or self.batch is None:
            return y  # no lane batch in this thread: the plain base
        A_Lri = self.batch.A.get(path)
        if A_Lri is None:
            return y
        # The input's shape, in this one place: every row owns a contiguous run of the
        # flattened leading axes ([B, T] rows of T tokens, [B * T] the same, and one lane
        # per token when the counts are equal), seen as `[rows, T, features]`.
        rows = self.batch.lane_B.shape[0]
        tokens = x.shape[:-1].numel()
        if x.dim() < 2 or rows == 0 or tokens % rows:
            raise ModelError(
                f"{path}: input of shape {tuple(x.shape)} does not match a lane batch "
                f"of {rows} entries; give one lane per row (first axis) or per token"
            )
        current = self.current(tokens // rows, int(A_Lri.shape[1]))
        assert current is not None
        batch, plan = current
        if x.dtype != A_Lri.dtype:
            x = x.to(A_Lri.dtype)
        return plan.apply(x, A_Lri, batch.B[path], y, rows, tokens // rows)


class MultiLoRALinear(nn.Module):
    """A frozen linear layer (`nn.Linear`, or GPT-2's `Conv1D`) plus the per-row LoRA
    update of the current lane batch.

    Inputs may have any leading shape whose row-major order keeps each lane-batch row's
    tokens together: `[B, T, in]`, the `[B * T, in]` that OPT's MLP and Qwen2-MoE's
    shared expert pass, `[B, in]`, or packed inputs with one lane per token. Layers that
    reorder tokens (MoE expert dispatch) are never wrapped (see `marlaas.model.arch`).
    """

    def __init__(self, base_layer: nn.Module, path: str, context: LaneContext) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.path = path
        self.in_features, self.out_features = layer_features(base_layer)
        #: PEFT's `fan_in_fan_out`: the base weight is stored `[in, out]` (Conv1D).
        self.fan_in_fan_out = isinstance(base_layer, Conv1D)
        self._context = context

    def forward(self, x: Tensor) -> Tensor:
        return self._context.add_update(self.path, x, self.base_layer(x))

    def extra_repr(self) -> str:
        return (
            f"path={self.path!r}, in_features={self.in_features}, out_features={self.out_features}"
        )
