"""A micro-batch's lanes: stacked lanes (tenants of one layout) give each tenant the
gradient that per-tenant views through autograd (`LoRAModel.lane_batch`) give it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from marlaas.config.specs import LoRASpec
from marlaas.model.lane_layers import LaneBatch
from marlaas.model.lora import LoRAModel
from marlaas.train.lanes import MicroLanes
from marlaas.train.optim import AdapterLayout


@dataclass
class _Tenant:
    lora: LoRASpec
    layout: AdapterLayout
    flat_P: Tensor


def _tenants(model: LoRAModel, specs: list[LoRASpec]) -> list[_Tenant]:
    g = torch.Generator().manual_seed(5)
    out = []
    for spec in specs:
        layout = AdapterLayout.for_spec(model, spec)
        flat = torch.randn(layout.numel, generator=g) * 0.1  # B non-zero: A gets gradient
        out.append(_Tenant(spec, layout, flat.requires_grad_(True)))
    return out


def _loss(model: LoRAModel, batch: LaneBatch, ids_BT: Tensor) -> Tensor:
    with model.lanes(batch):
        logits_BTV = model.base(input_ids=ids_BT, use_cache=False).logits
    w_V = torch.linspace(-1.0, 1.0, logits_BTV.shape[-1])
    return (logits_BTV.log_softmax(-1) * w_V).sum()


def test_stacked_lanes_give_each_tenant_its_autograd_gradient(lora_model: LoRAModel) -> None:
    spec = lora_model.resolve(LoRASpec(rank=4, alpha=8.0))
    other = lora_model.resolve(LoRASpec(rank=4, alpha=2.0))  # same layout, another scale
    tenants = _tenants(lora_model, [spec, other, spec])
    lane_B = torch.tensor([0, 0, 1, 2, 2])
    ids_BT = torch.randint(0, 64, (5, 7), generator=torch.Generator().manual_seed(1))

    plain = lora_model.lane_batch([(t.lora, t.layout.unflatten(t.flat_P)) for t in tenants], lane_B)
    _loss(lora_model, plain, ids_BT).backward()
    expected = [t.flat_P.grad.clone() for t in tenants if t.flat_P.grad is not None]
    for t in tenants:
        t.flat_P.grad = None

    for _ in range(2):  # two micro-batches accumulate
        lanes = MicroLanes.of(lora_model, tenants, lane_B, grad=True)
        assert lanes.leaves is not None  # the stacked path
        _loss(lora_model, lanes.batch, ids_BT).backward()
        lanes.accumulate()
    assert len(expected) == len(tenants)
    for t, grad in zip(tenants, expected, strict=True):
        assert t.flat_P.grad is not None and grad.abs().sum() > 0
        torch.testing.assert_close(t.flat_P.grad, 2 * grad, rtol=1e-4, atol=1e-6)


def test_mixed_layouts_fall_back_to_padded_lanes(lora_model: LoRAModel) -> None:
    specs = [lora_model.resolve(LoRASpec(rank=2)), lora_model.resolve(LoRASpec(rank=8))]
    tenants = _tenants(lora_model, specs)
    lanes = MicroLanes.of(lora_model, tenants, torch.tensor([0, 1]), grad=True)
    assert lanes.leaves is None
    assert next(iter(lanes.batch.A.values())).shape[1] == 8  # padded to the largest rank
    ids_BT = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(2))
    _loss(lora_model, lanes.batch, ids_BT).backward()
    lanes.accumulate()  # autograd already wrote the gradients; nothing added
    assert all(t.flat_P.grad is not None and t.flat_P.grad.abs().sum() > 0 for t in tenants)


def test_forward_only_lanes_hold_no_leaves(lora_model: LoRAModel) -> None:
    tenants = _tenants(lora_model, [lora_model.resolve(LoRASpec(rank=4))] * 2)
    lanes = MicroLanes.of(lora_model, tenants, torch.tensor([1, 0]), grad=False)
    assert lanes.leaves is None
    assert not any(a.requires_grad for a in lanes.batch.A.values())
    torch.testing.assert_close(
        next(iter(lanes.batch.A.values()))[1].reshape(-1),
        tenants[1].flat_P.detach()[: next(iter(lanes.batch.A.values()))[1].numel()],
    )
