"""The engine's compact decoder (`marlaas.rollout.decoder`) computes what the Hugging Face
modules compute: the same logits and the same keys and values in the slot cache, for
every architecture it covers (grouped heads, sliding windows, biases, Qwen3's per-head
norms), through prefill with left padding, a continued turn and decode steps, each row
with its own adapter; with the native kernels and with torch's ops (what other devices
run), in float32, bfloat16 and bfloat16 linear weights over float32 activations (a half
dtype on the CPU). Architectures it does not cover are left to the modules."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from rollout_support import VOCAB, decoder_model, forwards
from torch import Tensor

from helpers.tiny_archs import ARCHS, tiny_model
from marlaas.model import kernels
from marlaas.model.bank import AdapterBank
from marlaas.model.decoder import MODEL_TYPES
from marlaas.model.lora import LoRAModel
from marlaas.model.mixed import half_linears
from marlaas.rollout.decoder import CompactDecoder
from marlaas.rollout.kv import SlotKV


def _compare(
    got: tuple[list[Tensor], SlotKV, list[int]],
    want: tuple[list[Tensor], SlotKV, list[int]],
    atol: float,
) -> None:
    (logits, kv, lengths), (ref_logits, ref_kv, _) = got, want
    for a, b in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=0)
    # A half cache: a float32 ulp of difference can round to neighbouring half values;
    # a float32 one: keys and values up to ~12 in size carry their rounding (~1e-4 apart
    # where the two paths sum in different orders).
    rtol = 2.0**-7 if kv.dtype == torch.bfloat16 else 1e-5
    for layer in range(len(kv.keys)):
        for row, n in enumerate(lengths):
            for buffers, ref in ((kv.keys, ref_kv.keys), (kv.values, ref_kv.values)):
                torch.testing.assert_close(
                    buffers[layer][row, :, :n].float(),
                    ref[layer][row, :, :n].float(),
                    atol=atol,
                    rtol=rtol,
                )


def _modules_path(model: LoRAModel, bank: AdapterBank) -> tuple[list[Tensor], SlotKV, list[int]]:
    with kernels.torch_path():
        return forwards(model, bank)


@pytest.mark.parametrize("arch", MODEL_TYPES)
def test_logits_and_cache_equal_the_modules_with_the_native_kernels(arch: str) -> None:
    model, bank = decoder_model(arch, torch.float32)
    assert CompactDecoder.of(model) is not None
    assert kernels.native_kernels()
    _compare(forwards(model, bank), _modules_path(model, bank), atol=1e-4)


@pytest.mark.parametrize("arch", MODEL_TYPES)
def test_logits_and_cache_equal_the_modules_with_torchs_ops(
    arch: str, no_native_kernels: Any
) -> None:
    model, bank = decoder_model(arch, torch.float32)
    assert not kernels.native_kernels()
    _compare(forwards(model, bank), _modules_path(model, bank), atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_a_bfloat16_base_gives_the_modules_logits(arch: str) -> None:
    model, bank = decoder_model(arch, torch.bfloat16)
    assert model.dtype == torch.bfloat16
    _compare(forwards(model, bank), _modules_path(model, bank), atol=2e-2)


@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in MODEL_TYPES])
def test_other_architectures_are_left_to_the_modules(arch: str) -> None:
    model = LoRAModel(tiny_model(arch, VOCAB), max_rank=4)
    assert CompactDecoder.of(model) is None


def test_a_model_with_a_replaced_module_is_left_to_the_modules() -> None:
    base = tiny_model("llama", VOCAB)
    mlp = base.model.layers[1].mlp

    class ScaledMLP(type(mlp)):  # type: ignore[misc]
        def forward(self, x: Tensor) -> Tensor:
            return 2.0 * super().forward(x)

    mlp.__class__ = ScaledMLP
    assert CompactDecoder.of(LoRAModel(base, max_rank=4)) is None


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_half_linear_weights_give_the_modules_logits(arch: str) -> None:
    """A half dtype on the CPU (`marlaas.model.mixed`: bfloat16 linear weights over
    float32 activations): the compact decoder, the native kernels and the modules
    multiply alike, and cache keys and values in bfloat16 alike. Rounding an input to
    bfloat16 can turn a float32 ulp of difference into a bfloat16 one, hence a wider
    tolerance than float32's."""
    model, bank = decoder_model(arch, torch.float32)
    assert half_linears(model.base, torch.bfloat16) > 0
    assert model.dtype == torch.float32 and CompactDecoder.of(model) is not None
    assert model.kv_dtype == torch.bfloat16  # both paths write and read a half cache
    got = forwards(model, bank)
    assert got[1].buffer.dtype == torch.bfloat16
    _compare(got, _modules_path(model, bank), atol=2e-3)


def test_half_linear_weights_are_closer_to_float32_than_a_bfloat16_model() -> None:
    """What the float32 activations buy: the logits of bfloat16 linear weights over float32
    activations stay nearer the float32 model's than those of the whole model in
    bfloat16 (the same rounded weights, bfloat16 activations and cache)."""
    want = forwards(*decoder_model("llama", torch.float32))[0]
    mixed_model, mixed_bank = decoder_model("llama", torch.float32)
    half_linears(mixed_model.base, torch.bfloat16)
    mixed = forwards(mixed_model, mixed_bank)[0]
    whole = forwards(*decoder_model("llama", torch.bfloat16))[0]

    def error(got: list[Tensor]) -> float:
        return max(float((a.float() - b).abs().max()) for a, b in zip(got, want, strict=True))

    assert error(mixed) < error(whole) / 2
