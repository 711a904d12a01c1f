"""The multi-tenant optimizer: each tenant's adapter as one flat buffer, and AdamW over
many tenants at once, each with its own hyper-parameters, schedule and clipping.

A tenant's trainable state is one flat float32 leaf tensor (`flat_P`, `P` = parameter
count) laid out by an `AdapterLayout`: for every module the adapter targets, in the
base's module order, A `[r, in]` then B `[out, r]` (PEFT layout). The per-module tensors
handed to the multi-LoRA layers are views of it (`torch.split`), so a backward through
any number of micro-batches accumulates into one gradient per tenant, and the tenant's
global gradient norm is the norm of that one vector.

Invariants:
- Each tenant's update depends only on its own gradient, hyper-parameters and state.
  The batched ops below (`torch._foreach_*` with one scalar per tenant) are
  element-wise, so updating K tenants together gives bit-for-bit the update each would
  get alone.
- `adamw_step_` is the update of `torch.optim.AdamW` (decoupled weight decay,
  Loshchilov & Hutter 2019; bias-corrected moments, Kingma & Ba 2015, Alg. 1), applied
  in place under `no_grad`; the tests pin it against torch's own implementation.
- Clipping uses each tenant's own global norm: `g <- g * min(1, max_norm / (|g| + 1e-6))`,
  as `torch.nn.utils.clip_grad_norm_` does for one model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from marlaas.config.specs import GRPOSpec, LoRASpec, SFTSpec
from marlaas.errors import ConfigError, ModelError
from marlaas.model import kernels
from marlaas.model.lora import AdapterTensors, LoRAModel

_CLIP_EPS = 1e-6


@dataclass(frozen=True)
class AdapterLayout:
    """Where each module's A and B live in a tenant's flat parameter vector."""

    paths: tuple[str, ...]
    #: Per path: (A shape `(r, in)`, B shape `(out, r)`).
    shapes: tuple[tuple[tuple[int, int], tuple[int, int]], ...]

    @classmethod
    def for_spec(cls, model: LoRAModel, spec: LoRASpec) -> AdapterLayout:
        paths = tuple(model.module_paths(spec))
        module_shapes = model.module_shapes
        shapes = tuple(
            ((spec.rank, module_shapes[p][0]), (module_shapes[p][1], spec.rank)) for p in paths
        )
        return cls(paths=paths, shapes=shapes)

    @property
    def sizes(self) -> list[int]:
        return [n for (a, b) in self.shapes for n in (a[0] * a[1], b[0] * b[1])]

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    def flatten(
        self,
        tensors: Mapping[str, tuple[Tensor, Tensor]],
        device: torch.device | str = "cpu",
    ) -> Tensor:
        """A new float32 `[P]` vector holding `tensors` (which must match the layout)."""
        if set(tensors) != set(self.paths):
            raise ModelError("adapter tensors do not cover exactly the layout's modules")
        parts: list[Tensor] = []
        for path, (a_shape, b_shape) in zip(self.paths, self.shapes, strict=True):
            A, B = tensors[path]
            if tuple(A.shape) != a_shape or tuple(B.shape) != b_shape:
                raise ModelError(f"{path}: expected A {a_shape} and B {b_shape}")
            parts += [A.detach().reshape(-1), B.detach().reshape(-1)]
        return torch.cat(parts).to(device=device, dtype=torch.float32).contiguous()

    def unflatten(self, flat_P: Tensor) -> AdapterTensors:
        """Per-module views of `flat_P` (differentiable: gradients land in `flat_P`)."""
        parts = torch.split(flat_P, self.sizes)
        return {
            path: (parts[2 * i].view(a_shape), parts[2 * i + 1].view(b_shape))
            for i, (path, (a_shape, b_shape)) in enumerate(
                zip(self.paths, self.shapes, strict=True)
            )
        }

    def lane_tensors(self, flat_LP: Tensor) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Per-module lane views `A [L, r, in]` and `B [L, out, r]` of `flat_LP`, the flat
        vectors of `L` adapters of this layout stacked (`LaneBatch.A`, `LaneBatch.B`):
        two slices per module, however many lanes (differentiable)."""
        lanes = flat_LP.shape[0]
        A: dict[str, Tensor] = {}
        B: dict[str, Tensor] = {}
        offset = 0
        for path, (a_shape, b_shape) in zip(self.paths, self.shapes, strict=True):
            n_a, n_b = a_shape[0] * a_shape[1], b_shape[0] * b_shape[1]
            A[path] = flat_LP[:, offset : offset + n_a].view(lanes, *a_shape)
            B[path] = flat_LP[:, offset + n_a : offset + n_a + n_b].view(lanes, *b_shape)
            offset += n_a + n_b
        return A, B


@dataclass(frozen=True)
class AdamParams:
    """The AdamW hyper-parameters of one optimizer step of one tenant, with an optional
    learning-rate schedule over the tenant's optimizer steps.

    `max_grad_norm`: clip the tenant's gradient to this global norm first (None: no
    clipping). Schedule: constant when `warmup_steps == 0`, else linear warmup to `lr`
    over the first `warmup_steps` optimizer steps (step k, 0-based, uses
    `lr * (k + 1) / warmup`), then constant; a caller that schedules for itself passes
    the step's `lr` with `warmup_steps=0`.
    """

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        b1, b2 = self.betas
        if not (self.lr > 0 and 0 <= b1 < 1 and 0 <= b2 < 1 and self.eps > 0):
            raise ConfigError(
                f"AdamW needs lr > 0, 0 <= betas < 1 and eps > 0; got lr={self.lr}, "
                f"betas={self.betas}, eps={self.eps}"
            )
        clip_ok = self.max_grad_norm is None or self.max_grad_norm > 0
        if self.weight_decay < 0 or not clip_ok or self.warmup_steps < 0:
            raise ConfigError(
                "AdamW needs weight_decay >= 0, max_grad_norm > 0 (or None: no clipping) "
                f"and warmup_steps >= 0; got {self.weight_decay}, {self.max_grad_norm}, "
                f"{self.warmup_steps}"
            )

    @classmethod
    def from_spec(cls, algo: GRPOSpec | SFTSpec, warmup_steps: int = 0) -> AdamParams:
        return cls(
            lr=algo.learning_rate,
            betas=(float(algo.betas[0]), float(algo.betas[1])),
            weight_decay=algo.weight_decay,
            max_grad_norm=algo.max_grad_norm,
            warmup_steps=warmup_steps,
        )

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based)."""
        if self.warmup_steps == 0 or step >= self.warmup_steps:
            return self.lr
        return self.lr * (step + 1) / self.warmup_steps


@dataclass
class AdamState:
    """One tenant's AdamW moments and step count (the number of updates applied)."""

    step: int
    exp_avg_P: Tensor
    exp_avg_sq_P: Tensor

    @classmethod
    def zeros_like(cls, flat_P: Tensor) -> AdamState:
        return cls(
            step=0,
            exp_avg_P=torch.zeros_like(flat_P, requires_grad=False),
            exp_avg_sq_P=torch.zeros_like(flat_P, requires_grad=False),
        )

    def copy(self, device: torch.device | str = "cpu") -> AdamState:
        return AdamState(
            step=self.step,
            exp_avg_P=self.exp_avg_P.detach().to(device, copy=True),
            exp_avg_sq_P=self.exp_avg_sq_P.detach().to(device, copy=True),
        )


@dataclass(frozen=True)
class TenantSnapshot:
    """A detached copy of everything the device holds for a trainable tenant: its LoRA
    spec, adapter version and tensors (PEFT layout) and AdamW state. Tensors are float32
    on the CPU. Restoring one with `adam=None` starts a fresh optimizer (moments zero,
    step 0).

    There is no RNG state: a tenant's randomness (adapter init, data order, sampling
    seeds) is a pure function of its job seed and position (`pipeline.data`), so a
    restored tenant continues the same streams without one."""

    tenant: str
    lora: LoRASpec
    version: int
    tensors: AdapterTensors
    adam: AdamState | None = None


@dataclass(frozen=True)
class AlgorithmSnapshot:
    """A tenant's whole state, what its checkpoint holds: the device's `TenantSnapshot`
    and, in each algorithm's subclass, that algorithm's settings (`GRPOSnapshot`,
    `SFTSnapshot`)."""

    state: TenantSnapshot

    @property
    def tenant(self) -> str:
        return self.state.tenant

    @property
    def lora(self) -> LoRASpec:
        return self.state.lora

    @property
    def version(self) -> int:
        return self.state.version

    @property
    def adam(self) -> AdamState | None:
        return self.state.adam


@torch.no_grad()
def clip_grad_norms_(grads: Sequence[Tensor], max_norms: Sequence[float | None]) -> Tensor:
    """Clip each tenant's gradient by its own global norm, in place (a norm of None: no
    clipping); return the norms before clipping as a `[K]` tensor (no device sync)."""
    if not grads:
        return torch.zeros(0)
    norms_K = torch.stack(torch._foreach_norm(list(grads)))
    limits = [torch.inf if n is None else n for n in max_norms]
    limits_K = torch.tensor(limits, dtype=norms_K.dtype, device=norms_K.device)
    coef_K = (limits_K / (norms_K + _CLIP_EPS)).clamp(max=1.0)
    torch._foreach_mul_(list(grads), list(coef_K.unbind()))
    return norms_K


@torch.no_grad()
def adamw_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    states: Sequence[AdamState],
    configs: Sequence[AdamParams],
) -> list[float]:
    """One AdamW update of every tenant `k` (`params[k]` in place, `states[k]` advanced).

    Returns the learning rate each tenant used. All sequences are aligned by tenant.
    """
    if not len(params) == len(grads) == len(states) == len(configs):
        raise ConfigError("params, grads, states and configs must be aligned by tenant")
    if not params:
        return []
    tensors = _tensors(params, grads, states)
    if kernels.adamw_clipped_applies(tensors):  # one native call, no clipping
        return _native_step(tensors, states, configs, clip=False)[1]
    p, g = list(params), list(grads)
    m = [s.exp_avg_P for s in states]
    v = [s.exp_avg_sq_P for s in states]
    steps = _AdamSteps.of(states, configs)
    torch._foreach_mul_(p, steps.decay)
    torch._foreach_lerp_(m, g, [1.0 - b for b in steps.beta1])
    torch._foreach_mul_(v, steps.beta2)
    torch._foreach_addcmul_(v, g, g, [1.0 - b for b in steps.beta2])
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, steps.bias2_sqrt)
    torch._foreach_add_(denom, steps.eps)
    torch._foreach_addcdiv_(p, m, denom, steps.step)
    return steps.lrs


@torch.no_grad()
def clipped_adamw_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    states: Sequence[AdamState],
    configs: Sequence[AdamParams],
) -> tuple[list[float], list[float]]:
    """Each tenant's gradient clipped by its own norm (`configs[k].max_grad_norm`, as
    `clip_grad_norms_`), then its AdamW update (`adamw_step_`); the norms before
    clipping and the learning rates. Where the native kernel takes the tensors, every
    tenant in one call that reads each gradient as it goes (`kernels.adamw_clipped`: the
    gradients are left as they were), else torch's ops (clipped in place)."""
    if not len(params) == len(grads) == len(states) == len(configs):
        raise ConfigError("params, grads, states and configs must be aligned by tenant")
    tensors = _tensors(params, grads, states)
    if tensors and kernels.adamw_clipped_applies(tensors):
        return _native_step(tensors, states, configs, clip=True)
    norms_K = clip_grad_norms_(grads, [c.max_grad_norm for c in configs])
    return norms_K.tolist(), adamw_step_(params, grads, states, configs)


def _tensors(
    params: Sequence[Tensor], grads: Sequence[Tensor], states: Sequence[AdamState]
) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """Each tenant's `(p, g, m, v)`."""
    return [
        (p, g, s.exp_avg_P, s.exp_avg_sq_P) for p, g, s in zip(params, grads, states, strict=True)
    ]


def _native_step(
    tensors: list[tuple[Tensor, Tensor, Tensor, Tensor]],
    states: Sequence[AdamState],
    configs: Sequence[AdamParams],
    clip: bool,
) -> tuple[list[float], list[float]]:
    """Every tenant's update in one `kernels.adamw_clipped` call (with `clip`, each
    gradient clipped by its tenant's norm limit first); the norms and learning rates."""
    steps = _AdamSteps.of(states, configs)
    scalars = [
        (
            -1.0 if not clip or c.max_grad_norm is None else c.max_grad_norm,
            steps.decay[k],
            1.0 - steps.beta1[k],
            steps.beta2[k],
            steps.bias2_sqrt[k],
            steps.eps[k],
            steps.step[k],
            _CLIP_EPS,
        )
        for k, c in enumerate(configs)
    ]
    return kernels.adamw_clipped(tensors, scalars), steps.lrs


@dataclass(frozen=True)
class _AdamSteps:
    """Each tenant's scalars of one AdamW update (its state's step advanced)."""

    lrs: list[float]
    beta1: list[float]
    beta2: list[float]
    decay: list[float]
    bias2_sqrt: list[float]
    step: list[float]
    eps: list[float]

    @staticmethod
    def of(states: Sequence[AdamState], configs: Sequence[AdamParams]) -> _AdamSteps:
        lrs = [c.lr_at(s.step) for s, c in zip(states, configs, strict=True)]
        for s in states:
            s.step += 1
        beta1 = [c.betas[0] for c in configs]
        beta2 = [c.betas[1] for c in configs]
        bias1 = [1.0 - b**s.step for b, s in zip(beta1, states, strict=True)]
        return _AdamSteps(
            lrs=lrs,
            beta1=beta1,
            beta2=beta2,
            decay=[1.0 - lr * c.weight_decay for lr, c in zip(lrs, configs, strict=True)],
            bias2_sqrt=[(1.0 - b**s.step) ** 0.5 for b, s in zip(beta2, states, strict=True)],
            step=[-lr / b for lr, b in zip(lrs, bias1, strict=True)],
            eps=[c.eps for c in configs],
        )
