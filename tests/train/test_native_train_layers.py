"""The trainer's decoder layers in one native node each way (`marlaas.train.native`)
train like the compact forward's Python path: the same logits (float rounding) and,
every tenant, the same losses and gradients up to what bfloat16 products make of a
float32 ulp of difference (a product's input rounded one way or the other: ~1e-3 of
a gradient), through plain micro-batches, packed ones and shared prompts (the prefix
pass's keys and values, whose gradients come back from the suffix pass), adapters of
mixed ranks on some modules only and the plain base's pass of a KL term, for Llama,
Mistral's windows, Qwen2's biases and Qwen3's per-head norms; it declines what it does
not cover (float32 weights), and the Python path runs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_compact_training import _gradients
from torch import Tensor
from train_data import VOCAB, make_batch

import marlaas.train.decoder as decoder
import marlaas.train.prefix as prefix
from helpers.tiny_archs import tiny_model
from marlaas.config.specs import ALL_LINEAR, GRPOSpec, LoRASpec
from marlaas.model import kernels
from marlaas.model.lane_layers import LaneBatch
from marlaas.model.lora import LoRAModel
from marlaas.model.mixed import half_linears, native_bfloat16
from marlaas.train.decoder import TrainDecoder
from marlaas.train.grpo import GRPOTrainer
from marlaas.train.native import TrainLayers

pytestmark = pytest.mark.skipif(
    not (native_bfloat16("cpu") and kernels.native_kernels()),
    reason="the native layers cover bfloat16 linear weights on a CPU computing them natively",
)


def _half_model(arch: str) -> LoRAModel:
    """A tiny `arch` model with its linear layers' weights in bfloat16, as a half dtype
    on the CPU loads them (before the adapters' layers wrap them)."""
    base = tiny_model(arch, VOCAB)
    half_linears(base, torch.bfloat16)
    return LoRAModel(base, max_rank=16)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """Whether each native pass ran (True) or declined (False)."""
    seen: list[bool] = []
    run = TrainLayers.run

    def spy(self: TrainLayers, *args: Any) -> Any:
        out = run(self, *args)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(TrainLayers, "run", spy)
    yield seen


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
def test_trains_like_the_python_path(
    arch: str, shared: bool, pack: bool, calls: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(decoder.Packed, "MIN_PADDING", 0.0 if pack else 1.0)
    if not shared:
        monkeypatch.setattr(prefix, "MAX_COST", 0.0)
    model = _half_model(arch)
    got, got_sums = _gradients(model, modules=False, shared=shared)
    assert calls and all(calls)  # the plain base's pass of the KL term too
    with monkeypatch.context() as patch:
        patch.setattr(TrainLayers, "run", lambda *_: None)
        want, want_sums = _gradients(model, modules=False, shared=shared)
    for name, grad in want.items():
        assert got_sums[name] == pytest.approx(want_sums[name], rel=1e-3, abs=1e-4), name
        rel = float((got[name] - grad).norm() / grad.norm())
        assert rel < 1e-2, (name, rel)


def _one_spec_gradients(model: LoRAModel) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Every tenant's gradient and sums after one forward_backward of tenants of one LoRA
    spec (their lanes stacked, `train.lanes`: the native passes add into the
    micro-batch's gradient buffers), from adapters with random A and B."""
    trainer = GRPOTrainer(model, max_tokens_per_microbatch=4096)
    algo = GRPOSpec(group_size=4, prompts_per_step=2, kl_coef=0.1)
    names = ["u", "v", "w"]
    gen = torch.Generator().manual_seed(3)
    for i, name in enumerate(names):
        trainer.register(
            name, LoRASpec(rank=8, alpha=16.0, target_modules=ALL_LINEAR), algo, seed=i
        )
        flat = trainer.trainer._get(name).flat_P
        with torch.no_grad():
            flat.copy_(torch.randn(flat.shape, generator=gen) * 0.05)
    inputs = [
        trainer.training(name).train_input(make_batch(name, 0, algo, seed=20 + i, model=model))
        for i, name in enumerate(names)
    ]
    out = trainer.trainer.forward_backward(inputs)
    grads = {name: trainer.trainer._get(name).flat_P.grad for name in names}
    assert all(g is not None for g in grads.values())
    return {n: g for n, g in grads.items() if g is not None}, {n: out[n].sums for n in names}


@pytest.mark.parametrize("shared", [True, False])
def test_tenants_of_one_spec_train_like_the_python_path(
    shared: bool, calls: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stacked lanes (one layout, the usual case): A's and B's gradients from the native
    passes' buffers equal the Python path's from autograd, with the KL's base pass."""
    if not shared:
        monkeypatch.setattr(prefix, "MAX_COST", 0.0)
    model = _half_model("llama")
    got, got_sums = _one_spec_gradients(model)
    assert calls and all(calls)
    with monkeypatch.context() as patch:
        patch.setattr(TrainLayers, "run", lambda *_: None)
        want, want_sums = _one_spec_gradients(model)
    for name, grad in want.items():
        assert got_sums[name] == pytest.approx(want_sums[name], rel=1e-3, abs=1e-4), name
        assert float(grad.norm()) > 0
        rel = float((got[name] - grad).norm() / grad.norm())
        assert rel < 1e-2, (name, rel)


def _lanes(model: LoRAModel, decoder_: TrainDecoder, rank: int = 8) -> LaneBatch:
    """Three random lanes on every module, leaves with gradients."""
    gen = torch.Generator().manual_seed(5)
    A: dict[str, Tensor] = {}
    B: dict[str, Tensor] = {}
    for layer in decoder_.stack.layers:
        for name in ("q", "k", "v", "o", "gate", "up", "down"):
            lin = getattr(layer, name)
            out_features, in_features = lin.weight.shape
            A[lin.path] = (torch.randn(3, rank, in_features, generator=gen) / 8).requires_grad_()
            B[lin.path] = (torch.randn(3, out_features, rank, generator=gen) / 8).requires_grad_()
    return LaneBatch(torch.tensor([0, 2, 1, 2]), A, B, torch.tensor([2.0, 1.0, 0.5]))


def _prefix_then_suffix(
    decoder_: TrainDecoder, lanes: LaneBatch, native: bool, suffixes: tuple[int, ...]
) -> tuple[Tensor, dict[str, Tensor]]:
    """Logits of a suffix pass (rows of `suffixes` tokens) after a prefix pass whose
    cache it attends (left-padded prefixes, right-padded suffixes), and every lane
    weight's gradient of a random projection of them."""
    gen = torch.Generator().manual_seed(9)
    keep = decoder_.native
    decoder_.native = keep if native else None
    for t in (*lanes.A.values(), *lanes.B.values()):
        t.grad = None
    ids = torch.randint(4, VOCAB, (4, 6), generator=gen)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]] * 2 + [[0, 1, 1, 1, 1, 1]] * 2)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    _, past = decoder_.forward(ids, mask, pos, keep_cache=True, last_only=True, lanes=lanes)
    S = max(suffixes)
    suffix = torch.randint(4, VOCAB, (4, S), generator=gen)
    valid = torch.arange(S) < torch.tensor(suffixes)[:, None]
    key_mask = torch.cat([mask, valid.long()], 1)
    suffix_pos = pos[:, -1:] + 1 + torch.arange(S)
    out, _ = decoder_.forward(suffix, key_mask, suffix_pos, past=past, lanes=lanes)
    logits = out.padded(out.values)
    (logits * torch.randn(logits.shape, generator=gen) * valid[..., None]).sum().backward()
    decoder_.native = keep
    grads = {f"A {k}": t.grad for k, t in lanes.A.items()} | {
        f"B {k}": t.grad for k, t in lanes.B.items()
    }
    assert all(g is not None for g in grads.values())
    return logits.detach() * valid[..., None], {k: g for k, g in grads.items() if g is not None}


@pytest.mark.parametrize(
    ("arch", "suffixes"),
    [
        ("llama", (5, 2, 4, 1)),
        ("mistral", (5, 2, 4, 1)),
        ("qwen3", (5, 2, 4, 1)),
        # More tokens than a run of the forward (`chunks.h`): runs of whole rows, or of
        # a packed pass's tokens, the lanes interleaved within each.
        ("llama", (100, 40, 97, 3)),
        ("qwen3", (90, 110, 20, 60)),
    ],
)
def test_a_past_takes_its_gradients_from_the_suffix_pass(
    arch: str, suffixes: tuple[int, ...], calls: list[bool]
) -> None:
    """Every lane weight of every module, one by one: the prefix pass's gradient comes
    back through its keys and values."""
    model = _half_model(arch)
    decoder_ = TrainDecoder.of(model)
    assert decoder_ is not None and decoder_.native is not None
    lanes = _lanes(model, decoder_)
    got, got_grads = _prefix_then_suffix(decoder_, lanes, native=True, suffixes=suffixes)
    assert calls == [True, True]
    want, want_grads = _prefix_then_suffix(decoder_, lanes, native=False, suffixes=suffixes)
    assert float((got - want).norm() / want.norm()) < 5e-3
    for name, grad in want_grads.items():
        rel = float((got_grads[name] - grad).norm() / grad.norm())
        assert rel < 1e-2, (name, rel)


def test_an_input_that_needs_its_gradient_gets_it_through_the_first_layer(
    calls: list[bool],
) -> None:
    """The embeddings' gradient (where they train) comes back through every layer, the
    first one's q, k and v products and norm included, as on the Python path; frozen
    ones (every other test here) need none, and the first layer skips it."""
    model = _half_model("llama")
    decoder_ = TrainDecoder.of(model)
    assert decoder_ is not None and decoder_.native is not None
    lanes = _lanes(model, decoder_)
    embed = decoder_.stack.embed
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(4, VOCAB, (4, 7), generator=gen)
    mask = (torch.arange(7) < torch.tensor([7, 3, 5, 6])[:, None]).long()
    pos = torch.arange(7).expand(4, 7)
    weights = torch.randn(4, 7, VOCAB, generator=gen)
    keep = decoder_.native
    grads: list[Tensor] = []
    embed.requires_grad_(True)
    try:
        for native in (keep, None):
            decoder_.native = native
            embed.grad = None
            out, _ = decoder_.forward(ids, mask, pos, lanes=lanes)
            (out.padded(out.values) * weights * mask[..., None]).sum().backward()
            assert embed.grad is not None
            grads.append(embed.grad.clone())
    finally:
        decoder_.native = keep
        embed.requires_grad_(False)
        embed.grad = None
    assert calls == [True]
    got, want = grads
    assert float(want.norm()) > 0
    assert float((got - want).norm() / want.norm()) < 1e-2


def test_without_gradient_the_logits_are_the_python_paths() -> None:
    """No gradient: both paths' products take the same inputs, so no rounding to
    bfloat16 goes another way, and the logits agree to float32's rounding."""
    model = _half_model("qwen2")
    decoder_ = TrainDecoder.of(model)
    assert decoder_ is not None and decoder_.native is not None
    lanes = _lanes(model, decoder_)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(4, VOCAB, (4, 9), generator=gen)
    mask = (torch.arange(9) < torch.tensor([9, 4, 7, 2])[:, None]).long()
    pos = torch.arange(9).expand(4, 9)
    with torch.no_grad():
        got, _ = decoder_.forward(ids, mask, pos, lanes=lanes)
        keep, decoder_.native = decoder_.native, None
        want, _ = decoder_.forward(ids, mask, pos, lanes=lanes)
        decoder_.native = keep
    assert float((got.values - want.values).norm() / want.values.norm()) < 1e-5


def test_it_declines_what_it_does_not_cover() -> None:
    plain = TrainDecoder.of(LoRAModel(tiny_model("llama", VOCAB), max_rank=4))  # float32
    assert plain is not None and plain.native is None
