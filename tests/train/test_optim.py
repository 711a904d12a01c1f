"""The multi-tenant optimizer: AdamW and clipping per tenant, pinned against torch."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from helpers.native import kernels_off
from marlaas.config.specs import GRPOSpec, LoRASpec
from marlaas.errors import ConfigError
from marlaas.model import kernels
from marlaas.model.lora import LoRAModel
from marlaas.train.optim import (
    AdamParams,
    AdamState,
    AdapterLayout,
    adamw_step_,
    clip_grad_norms_,
    clipped_adamw_step_,
)

CONFIGS = [
    AdamParams(lr=1e-2),
    AdamParams(lr=3e-3, betas=(0.8, 0.95), weight_decay=0.1, eps=1e-6),
    AdamParams(lr=5e-2, betas=(0.5, 0.9), weight_decay=0.01, warmup_steps=3),
]


@pytest.fixture(params=["native", "torch"])
def kernel_or_torch(request: pytest.FixtureRequest) -> Iterator[str]:
    """The update through the native kernel (`kernels.adamw_clipped`) or torch's ops."""
    if request.param == "torch":
        with kernels_off():
            yield request.param
        return
    if not kernels.native_kernels("adamw_clipped"):
        pytest.skip("the native kernels are not built here")
    yield request.param


def test_adamw_matches_torch_for_every_tenant(kernel_or_torch: str) -> None:
    g = torch.Generator().manual_seed(0)
    sizes = [7, 130, 33]
    ours = [torch.randn(n, generator=g) for n in sizes]
    theirs = [p.clone().requires_grad_(True) for p in ours]
    torch_opts = [
        torch.optim.AdamW(
            [p], lr=c.lr, betas=c.betas, weight_decay=c.weight_decay, eps=c.eps, foreach=False
        )
        for p, c in zip(theirs, CONFIGS, strict=True)
    ]
    states = [AdamState.zeros_like(p) for p in ours]
    for step in range(6):
        grads = [torch.randn(n, generator=g) for n in sizes]
        lrs = adamw_step_(ours, grads, states, CONFIGS)
        assert lrs == [c.lr_at(step) for c in CONFIGS]
        for p, grad, opt, c in zip(theirs, grads, torch_opts, CONFIGS, strict=True):
            for group in opt.param_groups:
                group["lr"] = c.lr_at(step)
            p.grad = grad.clone()
            opt.step()
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-7)
    assert [s.step for s in states] == [6, 6, 6]


def test_together_is_bitwise_alone(kernel_or_torch: str) -> None:
    g = torch.Generator().manual_seed(1)
    params = [torch.randn(n, generator=g) for n in (5, 9, 4)]
    grads = [torch.randn_like(p) for p in params]
    alone = [p.clone() for p in params]
    states = [AdamState.zeros_like(p) for p in params]
    alone_states = [AdamState.zeros_like(p) for p in params]
    adamw_step_(params, grads, states, CONFIGS)
    for k in range(3):
        adamw_step_([alone[k]], [grads[k]], [alone_states[k]], [CONFIGS[k]])
        assert torch.equal(params[k], alone[k])


def test_clipping_uses_each_tenants_own_norm() -> None:
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(50, generator=g) * s for s in (0.01, 1.0, 10.0)]
    expected = [x.clone() for x in grads]
    limits = [1.0, 0.5, 2.0]
    norms = clip_grad_norms_(grads, limits)
    for x, e, limit, norm in zip(grads, expected, limits, norms.tolist(), strict=True):
        p = torch.zeros_like(e, requires_grad=True)
        p.grad = e
        ref = torch.nn.utils.clip_grad_norm_([p], limit)
        assert norm == pytest.approx(float(ref), rel=1e-6)
        torch.testing.assert_close(x, p.grad)
    assert norms[0] < limits[0] < norms[1]  # one tenant untouched, the others clipped


def test_the_clipped_step_is_clipping_then_adamw(kernel_or_torch: str) -> None:
    """`clipped_adamw_step_` (every tenant in one native call, each gradient read as it
    goes; or torch's ops) equals `clip_grad_norms_` then `adamw_step_`: the same norms,
    learning rates and updates, a tenant clipped, one not, one without a limit, over
    several steps; and each tenant's update is the one it gets alone, bit for bit."""
    g = torch.Generator().manual_seed(3)
    sizes = [7, 130, 33]
    configs = [
        AdamParams(lr=1e-2, max_grad_norm=0.5),
        AdamParams(lr=3e-3, betas=(0.8, 0.95), weight_decay=0.1, max_grad_norm=100.0),
        AdamParams(lr=5e-2, weight_decay=0.01, warmup_steps=2, max_grad_norm=None),
    ]
    fused = [torch.randn(n, generator=g) for n in sizes]
    split = [p.clone() for p in fused]
    fused_states = [AdamState.zeros_like(p) for p in fused]
    split_states = [AdamState.zeros_like(p) for p in fused]
    for _ in range(4):
        grads = [torch.randn(n, generator=g) * 3 for n in sizes]
        norms, lrs = clipped_adamw_step_(fused, [x.clone() for x in grads], fused_states, configs)
        clipped = [x.clone() for x in grads]
        want_norms = clip_grad_norms_(clipped, [c.max_grad_norm for c in configs])
        want_lrs = adamw_step_(split, clipped, split_states, configs)
        assert norms == pytest.approx(want_norms.tolist(), rel=1e-6)
        assert lrs == want_lrs
        for a, b in zip(fused, split, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert norms[0] > 0.5 and norms[1] < 100.0  # one clipped, one not
    assert [s.step for s in fused_states] == [4, 4, 4]
    alone = [p.clone() for p in fused]
    alone_states = [
        AdamState(s.step, s.exp_avg_P.clone(), s.exp_avg_sq_P.clone()) for s in fused_states
    ]
    grads = [torch.randn(n, generator=g) for n in sizes]
    clipped_adamw_step_(fused, [x.clone() for x in grads], fused_states, configs)
    for k in range(3):
        clipped_adamw_step_([alone[k]], [grads[k].clone()], [alone_states[k]], [configs[k]])
        assert torch.equal(fused[k], alone[k])


def test_warmup_schedule_and_validation() -> None:
    c = AdamParams(lr=1.0, warmup_steps=4)
    assert [c.lr_at(k) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert AdamParams(lr=2.0).lr_at(0) == 2.0
    spec = GRPOSpec(learning_rate=1e-3, betas=(0.8, 0.9), weight_decay=0.2, max_grad_norm=3.0)
    from_spec = AdamParams.from_spec(spec, warmup_steps=2)
    assert (from_spec.lr, from_spec.betas, from_spec.weight_decay) == (1e-3, (0.8, 0.9), 0.2)
    assert (from_spec.max_grad_norm, from_spec.warmup_steps) == (3.0, 2)
    with pytest.raises(ConfigError):
        AdamParams(lr=0.0)
    with pytest.raises(ConfigError):
        AdamParams(lr=1.0, warmup_steps=-1)


def test_layout_views_share_the_flat_buffer(lora_model: LoRAModel) -> None:
    spec = LoRASpec(rank=3, target_modules=("v_proj", "q_proj"))
    layout = AdapterLayout.for_spec(lora_model, spec)
    tensors = lora_model.init_adapter(spec, 0)
    flat = layout.flatten(tensors).requires_grad_(True)
    assert flat.shape == (layout.numel,)
    views = layout.unflatten(flat)
    assert list(views) == lora_model.module_paths(spec)
    for path, (A, B) in views.items():
        assert torch.equal(A, tensors[path][0]) and torch.equal(B, tensors[path][1])
    sum(A.sum() * 2 + B.sum() for A, B in views.values()).backward()
    assert flat.grad is not None
    a_elems = sum(a[0] * a[1] for a, _ in layout.shapes)
    assert float(flat.grad.sum()) == pytest.approx(2 * a_elems + (layout.numel - a_elems))
