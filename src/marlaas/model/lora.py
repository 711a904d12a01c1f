"""Multi-LoRA layers: one frozen base, a different LoRA adapter on every batch row.

Each injected linear layer of the base (`nn.Linear`, or GPT-2's `Conv1D`; by default
all but the output head, see `marlaas.model.arch`) is replaced, once per process, by a
`MultiLoRALinear` (`marlaas.model.lane_layers`) that wraps the original layer (same
module object, same parameters, nothing copied). Before a forward the caller sets a
`LaneBatch` with
`LoRAModel.lanes(...)`: a set of adapters stacked along a lane axis `L`, and for each
batch row the lane it uses. Every targeted layer then computes, with batched matmuls
over all rows (no loop over tenants):

    y_B = base(x_B) + scale_L[lane_B] * (x_B @ A_L[lane_B]^T) @ B_L[lane_B]^T

How the rows meet their lanes' weights is `marlaas.model.lane_plan`'s `LanePlan`,
made once per lane batch: blocks of consecutive rows of one lane (the trainer's
micro-batches: one block per tenant, straight on the stacked weights, no per-row weight
gather), or, for a decode batch whose rows alternate between tenants, each row on its
own lane's weights in place (the native CPU kernel, without gradients) or one padded
piece per lane (Punica's and S-LoRA's segments).

Invariants:
- The base's parameters are never written and never require grad. Gradients reach only
  the tensors of the lane batch, i.e. only the adapters of the tenants in the batch.
- Lanes of a lower rank are zero-padded to the batch's rank: the padding contributes
  exactly zero. A module a lane does not target holds zeros for that lane, a lane with
  `scale_L == 0` is the plain base, and a module absent from the lane batch (or a
  forward with no lane batch set) computes the plain base output.
- One lane batch at a time per model: `lanes()` holds a lock for its duration, and the
  lane batch is visible only to the thread that set it, so a plain forward in another
  thread never picks up someone else's adapters.
- Adapter tensors use PEFT's layout: A is `[r, in_features]`, B is `[out_features, r]`,
  keyed by the module's path in the base (e.g. `model.layers.0.self_attn.q_proj`).

Training note: the backward of a forward run inside `lanes()` may happen after the
context exits (autograd keeps the gathered tensors). Activation checkpointing, which
re-runs the forward during backward, must therefore run its backward inside `lanes()`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from marlaas.config.specs import LoRASpec, TargetModules
from marlaas.errors import ModelError
from marlaas.model.arch import (
    Role,
    adaptable_layers,
    check_attention,
    fused_weights,
    layer_features,
    layer_roles,
    leaf,
    output_head,
    resolve_targets,
)
from marlaas.model.lane_layers import LaneBatch, LaneContext, MultiLoRALinear
from marlaas.model.lane_plan import RowLanes
from marlaas.model.mixed import cache_dtype
from marlaas.model.mixed import linear as mixed_linear

#: One adapter in PEFT layout: module path -> (A [r, in], B [out, r]).
AdapterTensors = dict[str, tuple[Tensor, Tensor]]


class LoRAModel:
    """The frozen base with multi-LoRA layers injected, once per process.

    By default every layer LoRA can adapt gets a `MultiLoRALinear` (`marlaas.model.arch`:
    every linear and Conv1D layer but the output head), so a tenant may target any of
    them; a layer no resident adapter targets costs one dictionary lookup per forward.
    `target_modules` (leaf names) injects only those. A tenant's spec may target any
    injected leaf names, with any rank up to `max_rank`; `resolve` turns its
    `target_modules` into explicit names.
    """

    def __init__(
        self,
        base: PreTrainedModel,
        max_rank: int,
        target_modules: TargetModules = None,
    ) -> None:
        if max_rank < 1:
            raise ModelError(f"max_rank must be >= 1, got {max_rank}")
        if any(isinstance(m, MultiLoRALinear) for m in base.modules()):
            raise ModelError(
                "this base already has multi-LoRA layers; build one LoRAModel per base and "
                "share it between the rollout engine and the trainer"
            )
        check_attention(base.config)
        self.base = base
        self.max_rank = max_rank
        self._context = LaneContext()
        self._lock = threading.Lock()
        #: The weights of the last lane batch checked, by identity: the adapter bank hands
        #: the same slot views to every forward while its residents stand.
        self._checked: tuple[Mapping[str, Tensor], Mapping[str, Tensor], int] | None = None
        base.requires_grad_(False)

        layers = adaptable_layers(base)
        head = output_head(base)
        self._head_path = next((n for n, m in base.named_modules() if m is head), None)
        self._fused = fused_weights(base)
        self._skipped: set[str] = set()
        self.target_modules: tuple[str, ...] = self._resolve(
            target_modules, list(layers), "target_modules"
        )
        wanted = set(self.target_modules)
        self._shapes: dict[str, tuple[int, int]] = {}
        for path, layer in layers.items():
            if leaf(path) not in wanted:
                continue
            parent_path, _, name = path.rpartition(".")
            parent = base.get_submodule(parent_path) if parent_path else base
            setattr(parent, name, MultiLoRALinear(layer, path, self._context))
            self._shapes[path] = layer_features(layer)
        self._fan_in_fan_out = {path for path in self._shapes if isinstance(layers[path], Conv1D)}
        self._skipped = {leaf(p) for p in layers} - wanted
        #: Injected leaf name -> its roles ("attention", "mlp"), in module order.
        self.target_roles: dict[str, frozenset[Role]] = layer_roles(base, self._shapes)

    def _resolve(
        self, requested: TargetModules, paths: Sequence[str], option: str
    ) -> tuple[str, ...]:
        return resolve_targets(
            requested,
            paths,
            model_name=type(self.base).__name__,
            frozen=self._fused,
            head=self._head_path,
            skipped=self._skipped,
            option=option,
        )

    def resolve(self, spec: LoRASpec, default: TargetModules = None) -> LoRASpec:
        """`spec` with explicit `target_modules`: the injected leaf names it targets, in
        module order (unset: `default`, else every injected layer). Raises `ConfigError`
        naming `lora.target_modules` for names the base lacks or cannot adapt."""
        requested = spec.target_modules if spec.target_modules is not None else default
        names = self._resolve(requested, list(self._shapes), "lora.target_modules")
        if names == spec.target_modules:
            return spec
        return spec.model_copy(update={"target_modules": names})

    def fan_in_fan_out(self, path: str) -> bool:
        """Whether the injected layer at `path` stores its weight `[in, out]` (Conv1D)."""
        return path in self._fan_in_fan_out

    @property
    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """Module path -> (in_features, out_features), in the base's module order."""
        return dict(self._shapes)

    @property
    def device(self) -> torch.device:
        return next(self.base.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.base.parameters()).dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype the base's keys and values are held in (`mixed.cache_dtype`:
        bfloat16 on a CPU running bfloat16 linears, else `dtype`): the engine's cache's,
        and what the trainer's compact forward rounds them to."""
        return cache_dtype(self.base, self.dtype, self.device)

    # -- specs and tensors -------------------------------------------------------------

    def validate_spec(self, spec: LoRASpec) -> None:
        """Raise unless this model can serve an adapter of this shape: `ModelError` for a
        rank above `max_rank`, `ConfigError` for targets it did not inject."""
        self.targets(spec)

    def module_paths(self, spec: LoRASpec) -> list[str]:
        """The module paths an adapter of this spec covers, in the base's module order."""
        wanted = set(self.targets(spec))
        return [p for p in self._shapes if leaf(p) in wanted]

    def targets(self, spec: LoRASpec) -> tuple[str, ...]:
        """The leaf names `spec` adapts on this base (its `target_modules` resolved)."""
        if spec.rank > self.max_rank:
            raise ModelError(
                f"LoRA rank {spec.rank} exceeds this model's max_rank {self.max_rank}; "
                "lower the rank or start the service with a larger max_rank"
            )
        return self._resolve(spec.target_modules, list(self._shapes), "lora.target_modules")

    def check_tensors(self, spec: LoRASpec, tensors: Mapping[str, tuple[Tensor, Tensor]]) -> None:
        """Raise `ModelError` unless `tensors` is exactly an adapter of `spec` (PEFT layout)."""
        paths = self.module_paths(spec)
        missing = [p for p in paths if p not in tensors]
        extra = [p for p in tensors if p not in set(paths)]
        if missing or extra:
            raise ModelError(
                f"adapter tensors do not match the spec: missing {missing[:3]}"
                f"{'...' if len(missing) > 3 else ''}, unexpected {extra[:3]}"
                f"{'...' if len(extra) > 3 else ''}"
            )
        r = spec.rank
        for path in paths:
            fan_in, fan_out = self._shapes[path]
            A, B = tensors[path]
            if tuple(A.shape) != (r, fan_in) or tuple(B.shape) != (fan_out, r):
                raise ModelError(
                    f"{path}: expected A {(r, fan_in)} and B {(fan_out, r)} for rank {r}, "
                    f"got A {tuple(A.shape)} and B {tuple(B.shape)}"
                )

    def init_adapter(self, spec: LoRASpec, seed: int) -> AdapterTensors:
        """A fresh adapter with PEFT's default init: A kaiming-uniform(a=sqrt(5)), B zeros.

        float32 on the CPU, deterministic in `seed`; only the modules `spec` targets.
        """
        generator = torch.Generator().manual_seed(seed)
        out: AdapterTensors = {}
        for path in self.module_paths(spec):
            fan_in, fan_out = self._shapes[path]
            A = torch.empty(spec.rank, fan_in)
            if spec.rank > 0:
                nn.init.kaiming_uniform_(A, a=math.sqrt(5), generator=generator)
            out[path] = (A, torch.zeros(fan_out, spec.rank))
        return out

    def lane_batch(
        self,
        adapters: Sequence[tuple[LoRASpec, Mapping[str, tuple[Tensor, Tensor]]] | None],
        lane_B: Tensor,
    ) -> LaneBatch:
        """Stack per-tenant adapters into a lane batch (lane i = `adapters[i]`; None = base).

        Differentiable: built with `F.pad` and `torch.stack`, so gradients flow back to
        the given tensors (e.g. the trainer's leaf parameters). All tensors must share one
        device and dtype. The batch's rank is the largest rank among the lanes.
        """
        present = [a for a in adapters if a is not None]
        for spec, tensors in present:
            self.check_tensors(spec, tensors)
        if present:
            ref = next(iter(present[0][1].values()))[0]  # device and dtype of the lanes
        else:
            ref = torch.empty(0, dtype=self.dtype, device=self.device)
        r = max([spec.rank for spec, _ in present] + [1])
        scale_L = torch.tensor(
            [a[0].scaling if a is not None else 0.0 for a in adapters],
            dtype=torch.float32,
            device=ref.device,
        )
        A: dict[str, Tensor] = {}
        B: dict[str, Tensor] = {}
        for path, (fan_in, fan_out) in self._shapes.items():
            if not any(path in tensors for _, tensors in present):
                continue
            A_list: list[Tensor] = []
            B_list: list[Tensor] = []
            for adapter in adapters:
                if adapter is None or path not in adapter[1]:
                    A_list.append(ref.new_zeros(r, fan_in))
                    B_list.append(ref.new_zeros(fan_out, r))
                    continue
                A_ri, B_or = adapter[1][path]
                pad = r - A_ri.shape[0]  # torch.stack copies anyway: pad only when needed
                A_list.append(F.pad(A_ri, (0, 0, 0, pad)) if pad else A_ri)
                B_list.append(F.pad(B_or, (0, pad)) if pad else B_or)
            A[path] = torch.stack(A_list)
            B[path] = torch.stack(B_list)
        return LaneBatch(lane_B=lane_B, A=A, B=B, scale_L=scale_L)

    # -- forward context ---------------------------------------------------------------

    def row_lanes(self, tokens: int) -> tuple[LaneBatch, RowLanes] | None:
        """The lane batch of this thread's `lanes()` context and its rows for the native
        kernels, for inputs of `tokens` tokens (`LaneContext.row_lanes`)."""
        return self._context.row_lanes(tokens)

    def add_lora(self, path: str, x: Tensor, y: Tensor) -> Tensor:
        """`y` plus module `path`'s LoRA update for input `x` under the lane batch of the
        current `lanes()` context, exactly what the injected layer adds: for forwards
        that run the base's layers themselves (`marlaas.rollout.decoder`). `y` may be
        written in place."""
        return self._context.add_update(path, x, y)

    def lora_linear(self, path: str, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """`F.linear(x, weight, bias)` plus module `path`'s LoRA update (the current
        lane batch's), as `add_lora` after the base layer, in one autograd node where the
        lane plan has one (a trainer's packed forward: `LanePlan.linear`)."""
        if torch.is_grad_enabled():  # the engine's forwards (no gradient) skip the lookup
            fused = self._context.linear(path, x, weight, bias)
            if fused is not None:
                return fused
        return self._context.add_update(path, x, mixed_linear(x, weight, bias))

    def _check_lane_batch(self, batch: LaneBatch) -> None:
        if batch.lane_B.dim() != 1 or batch.lane_B.dtype != torch.long:
            raise ModelError("lane_B must be a 1-D LongTensor (one lane index per row)")
        if batch.scale_L.dim() != 1:
            raise ModelError("scale_L must be 1-D (one scale per lane)")
        L = batch.num_lanes
        checked = self._checked
        if checked is None or not (
            checked[0] is batch.A and checked[1] is batch.B and checked[2] == L
        ):  # not the same weights as the last batch (the adapter bank's slot views)
            self._check_weights(batch.A, batch.B, L)
            self._checked = (batch.A, batch.B, L)
        if batch.lane_B.device.type == "cpu" and batch.lane_B.numel() > 0:
            lo, hi = (int(v) for v in torch.aminmax(batch.lane_B))
            if lo < 0 or hi >= L:
                raise ModelError(f"lane_B holds lane {lo if lo < 0 else hi}, outside [0, {L})")

    def _check_weights(self, A: Mapping[str, Tensor], B: Mapping[str, Tensor], L: int) -> None:
        if set(A) != set(B):
            raise ModelError("a lane batch needs the same module paths in A and B")
        for path, A_Lri in A.items():
            shape = self._shapes.get(path)
            if shape is None:
                raise ModelError(f"lane batch names module {path!r}, which was not injected")
            fan_in, fan_out = shape
            B_Lor = B[path]
            if (
                A_Lri.dim() != 3
                or B_Lor.dim() != 3
                or tuple(A_Lri.shape[::2]) != (L, fan_in)
                or tuple(B_Lor.shape[:2]) != (L, fan_out)
                or A_Lri.shape[1] != B_Lor.shape[2]
            ):
                raise ModelError(
                    f"{path}: expected A [{L}, r, {fan_in}] and B [{L}, {fan_out}, r], got "
                    f"A {list(A_Lri.shape)} and B {list(B_Lor.shape)}"
                )

    @contextmanager
    def lanes(self, batch: LaneBatch) -> Iterator[None]:
        """Use `batch` for every forward run by this thread inside the `with` block."""
        if self._context.owner == threading.get_ident():
            raise ModelError("lanes() is already active in this thread; contexts do not nest")
        self._check_lane_batch(batch)
        scale_B = batch.scale_L[batch.lane_B]
        with self._lock:
            self._context.batch = batch
            self._context.scale_B = scale_B
            self._context.owner = threading.get_ident()
            try:
                yield
            finally:
                self._context.owner = None
                self._context.batch = None
                self._context.scale_B = None
                self._context.plan = None
