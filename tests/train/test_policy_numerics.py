"""Trainer and engine compute one policy. With bfloat16 linear weights over float32
activations (the CPU's half dtype, `marlaas.model.mixed`) the engine holds keys and values
in bfloat16 (`mixed.cache_dtype`) and the trainer's compact forward rounds its own alike,
so both give the same logits over the same tokens up to the products' rounding: the
importance ratio of on-policy data stays at rounding noise (the learning test sees it)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import marlaas.train.decoder as train_decoder
from helpers.tiny_archs import tiny_model
from marlaas.config.specs import LoRASpec
from marlaas.model.bank import AdapterBank
from marlaas.model.lora import AdapterTensors, LoRAModel
from marlaas.model.mixed import half_linears
from marlaas.model.tokenizer import build_tokenizer
from marlaas.rollout.forward import RowForward
from marlaas.rollout.kv import SlotKV, kv_geometry
from marlaas.train.decoder import TrainDecoder

VOCAB = len(build_tokenizer())
SPEC = LoRASpec(rank=4, alpha=8.0)


def _adapter(model: LoRAModel, seed: int) -> AdapterTensors:
    g = torch.Generator().manual_seed(seed)
    spec = model.resolve(SPEC)
    return {
        path: (
            torch.randn(spec.rank, model.module_shapes[path][0], generator=g) * 0.3,
            torch.randn(model.module_shapes[path][1], spec.rank, generator=g) * 0.3,
        )
        for path in model.module_paths(spec)
    }


def _engine_logits(model: LoRAModel, adapters: list[AdapterTensors], ids: Tensor) -> Tensor:
    """A prefill of each row under its own adapter, every position's logits."""
    spec = model.resolve(SPEC)
    bank = AdapterBank(model, num_slots=len(adapters), dtype=torch.float32)
    for i, tensors in enumerate(adapters):
        bank.register(f"t{i}", spec, tensors=tensors)
    R = int(ids.shape[0])
    kv = SlotKV(kv_geometry(model.base.config), model.kv_dtype, model.device, R, 128)
    slot_R = torch.tensor([bank.acquire(f"t{i}").slot for i in range(R)])
    with torch.no_grad():
        return RowForward(model, bank, kv).prefill(0, slot_R, [0] * R, ids.tolist(), 0, True)


def _trainer_logits(model: LoRAModel, adapters: list[AdapterTensors], ids: Tensor) -> Tensor:
    decoder = TrainDecoder.of(model)
    assert decoder is not None
    spec = model.resolve(SPEC)
    R, T = (int(n) for n in ids.shape)
    lanes = model.lane_batch([(spec, a) for a in adapters], torch.arange(R))
    pos = torch.arange(T).expand(R, T)
    with torch.no_grad():
        logits, _ = decoder.forward(ids, torch.ones(R, T), pos, lanes=lanes)
    return logits.padded(logits.values)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_trainer_rounds_keys_and_values_as_the_engines_cache_holds_them(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = LoRAModel(tiny_model(arch, VOCAB), max_rank=4)
    half_linears(model.base, torch.bfloat16)
    assert model.kv_dtype == torch.bfloat16
    adapters = [_adapter(model, seed) for seed in (1, 2, 3)]
    ids = torch.randint(4, VOCAB, (3, 24), generator=torch.Generator().manual_seed(0))
    engine = _engine_logits(model, adapters, ids)

    def error() -> float:
        return float((_trainer_logits(model, adapters, ids) - engine).abs().max())

    rounded = error()
    monkeypatch.setattr(train_decoder, "round_to", lambda x, dtype: x)
    unrounded = error()
    # The products' rounding remains (the engine multiplies q/k/v as one product, the
    # trainer each with its LoRA: a float32 ulp may land on another bfloat16), and one
    # key rounded to the next bfloat16 moves this tiny model's logits by up to ~1e-2:
    # over four seeds, 1e-4 .. 1.6e-2 rounded, 0.05 .. 0.85 not.
    assert rounded < unrounded / 4, (rounded, unrounded)


def test_round_to_rounds_forward_and_passes_the_gradient() -> None:
    from marlaas.model.fused import round_to

    x = torch.randn(5, 7, requires_grad=True)
    y = round_to(x, torch.bfloat16)
    assert y.dtype == torch.float32 and torch.equal(y, x.detach().bfloat16().float())
    (y * torch.arange(7.0)).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.arange(7.0).expand(5, 7))
    assert round_to(x, torch.float32) is x
