"""The trainer's compact forward (`marlaas.train.decoder`) trains like the Hugging Face
modules: the same losses and the same gradients for every tenant, through plain
micro-batches (right padding) and shared prompts (a left-padded prefix pass and its
cache), on every architecture it covers (grouped heads, biases, sliding windows shorter
than the prompts, Qwen3's per-head norms); and a base it does not cover keeps the
modules."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_shared_prefix import _data
from test_trainer import TENANTS, _register
from torch import Tensor
from train_data import VOCAB

import marlaas.model.lane_plan as lane_plan
import marlaas.train.decoder as decoder
import marlaas.train.prefix as prefix
from helpers.tiny_archs import ARCHS, tiny_model
from marlaas.model import kernels
from marlaas.model.decoder import MODEL_TYPES
from marlaas.model.lora import LoRAModel
from marlaas.model.mixed import half_linears
from marlaas.train.decoder import TrainDecoder
from marlaas.train.grpo import GRPOTrainer


def _gradients(
    model: LoRAModel, modules: bool, shared: bool
) -> tuple[dict[str, Tensor], dict[str, dict[str, float]]]:
    """Every tenant's accumulated gradient and sums (loss and metrics: entropy, ratio,
    KL...) after one forward_backward over a step of grouped samples (whose prompts the
    trainer shares, or not)."""
    trainer = GRPOTrainer(model, max_tokens_per_microbatch=4096)
    for i, name in enumerate(TENANTS):
        _register(trainer, name, seed=i)
    data = _data(model, 1)
    inputs = [trainer.training(name).train_input(data[name][0]) for name in TENANTS]
    if modules:
        with kernels.torch_path():
            out = trainer.trainer.forward_backward(inputs)
    else:
        assert trainer.trainer.decoder is not None
        out = trainer.trainer.forward_backward(inputs)
    assert (trainer.stats.shared_prefix_microbatches >= 1) == shared
    grads = {name: trainer.trainer._get(name).flat_P.grad for name in TENANTS}
    assert all(g is not None for g in grads.values())
    return {n: g for n, g in grads.items() if g is not None}, {
        name: out[name].sums for name in TENANTS
    }


def _trains_like_the_modules(
    model: LoRAModel, shared: bool, loss_tol: tuple[float, float], grad_rel: float
) -> None:
    """The compact forward's losses and metrics (`loss_tol`: rel, abs) and gradients
    (relative norm of the difference below `grad_rel`) against the modules', every
    tenant."""
    got, got_sums = _gradients(model, modules=False, shared=shared)
    want, want_sums = _gradients(model, modules=True, shared=shared)
    rel_tol, abs_tol = loss_tol
    for name in TENANTS:
        assert {"loss", "entropy", "ratio"} <= set(want_sums[name])
        assert got_sums[name] == pytest.approx(want_sums[name], rel=rel_tol, abs=abs_tol), name
        rel = float((got[name] - want[name]).norm() / want[name].norm())
        assert rel < grad_rel, (name, rel)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("arch", MODEL_TYPES)
def test_gradients_and_losses_equal_the_modules(
    arch: str, shared: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not shared:
        monkeypatch.setattr(prefix, "MAX_COST", 0.0)  # never pays: plain micro-batches
    model = LoRAModel(tiny_model(arch, VOCAB), max_rank=16)
    _trains_like_the_modules(model, shared, (1e-5, 1e-6), 1e-5)


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_half_linear_weights_train_like_the_modules(
    arch: str, pack: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bfloat16 linear weights over float32 activations (a half dtype on the CPU): the
    compact forward and its backward multiply as the modules do (`marlaas.model.mixed`),
    packed (each linear layer and its LoRA one node, `RowsLoRA` with the half base
    weight) or not; a float32 ulp of difference may round to a bfloat16 one, hence the
    tolerance (the span kernel's sums in another order than torch's: up to 1.2e-4
    relative on a tenant's KL to the behaviour policy). The compact forward's rounding of keys and values to the engine's cache
    dtype, which the modules do not do, is off here (`test_policy_numerics` pins it)."""
    monkeypatch.setattr(decoder.Packed, "MIN_PADDING", 0.0 if pack else 1.0)
    monkeypatch.setattr(decoder, "round_to", lambda x, dtype: x)
    fused: list[torch.dtype] = []
    linear = lane_plan.LanePlan.linear

    def watched(self: lane_plan.LanePlan, x: Tensor, W: Tensor, *rest: Any) -> Tensor | None:
        out = linear(self, x, W, *rest)
        if out is not None:
            fused.append(W.dtype)
        return out

    monkeypatch.setattr(lane_plan.LanePlan, "linear", watched)
    model = LoRAModel(tiny_model(arch, VOCAB), max_rank=16)
    assert half_linears(model.base, torch.bfloat16) > 0
    _trains_like_the_modules(model, True, (3e-4, 1e-4), 5e-3)
    assert (set(fused) == {torch.bfloat16}) if pack else not fused


@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in MODEL_TYPES])
def test_other_architectures_keep_the_modules(arch: str) -> None:
    assert TrainDecoder.of(LoRAModel(tiny_model(arch, VOCAB), max_rank=4)) is None


def test_repeated_key_value_heads_give_the_same_gradients(
    monkeypatch: pytest.MonkeyPatch, no_native_kernels: None
) -> None:
    """Without the native kernels and with SDPA taken not to group heads (as off the
    CPU), the key and value heads are repeated: the same gradients as the modules."""
    monkeypatch.setattr(decoder, "sdpa_groups_heads", lambda device: False)
    model = LoRAModel(tiny_model("qwen2", VOCAB), max_rank=16)
    assert model.base.config.num_key_value_heads < model.base.config.num_attention_heads
    _trains_like_the_modules(model, True, (1e-5, 1e-6), 1e-5)


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_packed_and_padded_forwards_train_like_the_modules(
    arch: str, pack: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compact forward with its valid tokens packed (`Packed`: every forward, however
    little padding) and with none packed: the modules' losses and gradients, shared
    prompts or not."""
    monkeypatch.setattr(decoder.Packed, "MIN_PADDING", 0.0 if pack else 1.0)
    seen: list[bool] = []
    of = decoder.Packed.of

    def watched(valid_BT: Tensor) -> decoder.Packed | None:
        packed = of(valid_BT)
        seen.append(packed is not None)
        return packed

    monkeypatch.setattr(decoder.Packed, "of", staticmethod(watched))
    model = LoRAModel(tiny_model(arch, VOCAB), max_rank=16)
    _trains_like_the_modules(model, True, (1e-5, 1e-6), 1e-5)
    assert seen and all(s == pack for s in seen)


def test_packing_needs_enough_padding() -> None:
    """`Packed.of`: rows with under `MIN_PADDING` padding run as they are; the packing
    keeps the valid tokens in row-major order and each row's last."""
    full = torch.ones(4, 10, dtype=torch.bool)
    assert decoder.Packed.of(full) is None
    valid = torch.arange(10) < torch.tensor([10, 3, 7, 1])[:, None]
    packed = decoder.Packed.of(valid)
    assert packed is not None
    ids = torch.arange(40).view(4, 10)
    rows = packed.rows(ids)
    assert rows.tolist() == [[*range(10), 10, 11, 12, *range(20, 27), 30]]
    assert rows[0, packed.last_B].tolist() == [9, 12, 26, 30]
    back = packed.padded(rows.unsqueeze(-1)).squeeze(-1)
    assert torch.equal(back, torch.where(valid, ids, 0))
