"""The LoRA lanes of one trainer micro-batch, and how their gradients reach the tenants.

Tenants of one `AdapterLayout` (the usual case: one LoRA spec) have their flat vectors
stacked once per micro-batch, `[L, P]`, and every module's lanes are views of that stack
made leaves of the micro-batch's graph: the Python layers' backward writes one gradient
per module and pass into its leaves, the native passes write theirs into one set of
buffers per module for the whole micro-batch (`LaneBatch.grads`, `LaneGrads`: a lane's
first block written, the rest added; no zero-filled gradient, no sum of the passes' by
autograd), and `accumulate` lays both out as `[L, P]`,
whose rows become the tenants' flat gradients (a row each, no copy) or are added into
those they already have.
Built through autograd instead (stack, then slices), every module's slice would
materialise a zero-filled `[L, P]` gradient in the backward, and per-tenant views
(`LoRAModel.lane_batch`) make one stack and `L` view nodes per module.

Tenants of different layouts (mixed ranks or targets) go through `LoRAModel.lane_batch`,
which pads each module's lanes to the largest rank; autograd then carries the gradients
straight to the flat vectors and `accumulate` has nothing to do.

Either way, each tenant's flat gradient receives exactly the gradient of its own rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from marlaas.config.specs import LoRASpec
from marlaas.model.kernels import gather_grads
from marlaas.model.lane_layers import LaneBatch
from marlaas.model.lora import LoRAModel
from marlaas.train.optim import AdapterLayout


class TenantLane(Protocol):
    """What a lane needs of a tenant: its spec, layout and flat leaf parameter."""

    @property
    def lora(self) -> LoRASpec: ...
    @property
    def layout(self) -> AdapterLayout: ...
    @property
    def flat_P(self) -> Tensor: ...


@dataclass(frozen=True)
class MicroLanes:
    """A micro-batch's `LaneBatch`, and for stacked lanes their leaves (see module doc)."""

    batch: LaneBatch
    tenants: tuple[TenantLane, ...]
    #: Stacked lanes: per module path, in layout order, the `A` and `B` leaves.
    leaves: tuple[tuple[Tensor, Tensor], ...] | None

    @staticmethod
    def of(
        model: LoRAModel, tenants: Sequence[TenantLane], lane_B: Tensor, grad: bool
    ) -> MicroLanes:
        layout = tenants[0].layout
        if any(t.layout != layout for t in tenants):
            batch = model.lane_batch(
                [(t.lora, t.layout.unflatten(t.flat_P)) for t in tenants], lane_B
            )
            return MicroLanes(batch, tuple(tenants), None)
        with torch.no_grad():
            flat_LP = torch.stack([t.flat_P for t in tenants])
        A, B = layout.lane_tensors(flat_LP)
        if grad:
            A = {p: a.detach().requires_grad_(True) for p, a in A.items()}
            B = {p: b.detach().requires_grad_(True) for p, b in B.items()}
        scale_L = torch.tensor(
            [t.lora.scaling for t in tenants], dtype=torch.float32, device=flat_LP.device
        )
        # A native backward writes into one set of buffers per module for all the passes.
        batch = LaneBatch(lane_B=lane_B, A=A, B=B, scale_L=scale_L, grads={} if grad else None)
        leaves = tuple((A[p], B[p]) for p in layout.paths) if grad else None
        return MicroLanes(batch, tuple(tenants), leaves)

    def accumulate(self) -> None:
        """After the backward: add the stacked lanes' gradients into each tenant's flat
        gradient: per module, what native passes added into the batch's buffers
        (`LaneBatch.grads`, laid out in one native call) plus what autograd left on its
        leaves (the Python layers'); zeros for a module no pass reached."""
        if self.leaves is None:
            return
        lanes = len(self.tenants)
        buffers = self.batch.grads or {}
        paths = self.tenants[0].layout.paths
        sunk = [buffers.get(path) for path in paths]
        modules = [
            (s, int(A.shape[1]), int(A.shape[2]), int(B.shape[1]))
            for s, (A, B) in zip(sunk, self.leaves, strict=True)
        ]
        # Each leaf's elements per lane, from the shapes (an index a leaf is an op).
        sizes = [(r * i, o * r) for _, r, i, o in modules]
        width = sum(a + b for a, b in sizes)
        grad_LP = torch.empty((lanes, width), device=self.leaves[0][0].device)
        with torch.no_grad():
            # The buffers in one native call; where it declines, zeros (then added below).
            laid = gather_grads(modules, grad_LP)
            if not laid:
                grad_LP.zero_()
            at = 0
            for (A, B), grads, per_lane in zip(self.leaves, sunk, sizes, strict=True):
                # The buffers where the call declined (B's in PEFT's layout), and the
                # Python layers' gradients where they ran.
                unlaid: tuple[Tensor | None, Tensor | None] = (None, None)
                if not laid and grads is not None:
                    gA, gBt = grads.settled()
                    unlaid = (gA, gBt.transpose(1, 2))
                for leaf, buffer, n in zip((A, B), unlaid, per_lane, strict=True):
                    adds = [g for g in (buffer, leaf.grad) if g is not None]
                    if adds:  # (no slice per module otherwise: a one-tenant step pays for it)
                        part = grad_LP[:, at : at + n].view(leaf.shape)
                        for g in adds:
                            part.add_(g)
                    at += n
            for tenant, grad_P in zip(self.tenants, grad_LP, strict=True):
                if tenant.flat_P.grad is None:
                    tenant.flat_P.grad = grad_P  # a row of this micro-batch's own buffer
                else:
                    tenant.flat_P.grad.add_(grad_P)
