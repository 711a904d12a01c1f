"""The engine on architectures with sliding windows and mixed layer types (Mistral, Qwen2
and Qwen3 with `use_sliding_window`, Gemma2 with soft-capping, Gemma3): tokens and
log-probs equal the model's own forward over the whole sequence, with the adapter merged,
for rows of different lengths decoded together, each longer than the window."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rollout_support import SPEC, merged, random_adapter
from transformers import AutoModelForCausalLM

from helpers.tiny_archs import ARCHS, WINDOW, save_tiny
from marlaas.model.bank import AdapterBank
from marlaas.model.base import load_base
from marlaas.model.lora import LoRAModel
from marlaas.rollout import RolloutEngine
from marlaas.rollout.kv import kv_geometry
from marlaas.types import RolloutRequest, SamplingParams


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_and_logprobs_equal_the_models_own_forward(arch: str, tmp_path: Path) -> None:
    path = save_tiny(arch, tmp_path / arch)
    base, tokenizer = load_base(path)
    windows = kv_geometry(base.config).windows
    assert (arch == "llama") == all(w is None for w in windows)
    model = LoRAModel(base, max_rank=4, target_modules=SPEC.target_modules)
    bank = AdapterBank(model, num_slots=4)
    for i in range(2):
        bank.register(f"t{i}", SPEC, tensors=random_adapter(model, 40 + i))
    engine = RolloutEngine(model, bank, tokenizer, eos_token_ids=[], background=False)
    gen = torch.Generator().manual_seed(1)
    lengths = [WINDOW + 3, 2 * WINDOW + 5, WINDOW + 8, 3 * WINDOW]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=2 * WINDOW)
    requests = [
        RolloutRequest(
            tenant=f"t{i % 2}",
            prompt_ids=tuple(torch.randint(2, len(tokenizer), (n,), generator=gen).tolist()),
            sampling=greedy,
        )
        for i, n in enumerate(lengths)
    ]
    outs = engine.generate(requests)
    for request, out in zip(requests, outs, strict=True):
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        reference = merged(reference, bank.tensors(request.tenant), SPEC)
        full = torch.tensor([request.prompt_ids + out.token_ids])
        with torch.no_grad():
            logits = reference(full).logits[0, len(request.prompt_ids) - 1 : -1]
        assert list(out.token_ids) == logits.argmax(-1).tolist(), arch
        want = torch.log_softmax(logits.float(), -1)[
            torch.arange(len(out.token_ids)), full[0, len(request.prompt_ids) :]
        ]
        torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=1e-4, rtol=0)


def test_a_bfloat16_base_samples_what_its_own_forward_gives(tmp_path: Path) -> None:
    """bf16 base, KV cache and attention products, float32 adapters and log-probs: the
    engine's log-probs of its tokens are the same model's full forward's, to bf16 noise."""
    base, tokenizer = load_base(save_tiny("qwen2", tmp_path / "m"), dtype=torch.bfloat16)
    model = LoRAModel(base, max_rank=4, target_modules=SPEC.target_modules)
    bank = AdapterBank(model, num_slots=2, dtype=torch.float32)
    bank.register("t0", SPEC, tensors=random_adapter(model, 7))
    engine = RolloutEngine(model, bank, tokenizer, eos_token_ids=[], background=False)
    prompt = tuple(range(10, 10 + 3 * WINDOW))
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
    out = engine.generate([RolloutRequest(tenant="t0", prompt_ids=prompt, sampling=params)])[0]
    lanes = model.lane_batch([(SPEC, bank.tensors("t0"))], torch.zeros(1, dtype=torch.long))
    full = torch.tensor([prompt + out.token_ids])
    with torch.no_grad(), model.lanes(lanes):
        logits = base(full).logits[0, len(prompt) - 1 : -1].float()
    want = torch.log_softmax(logits, -1)[torch.arange(8), full[0, len(prompt) :]]
    torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=0.02, rtol=0)
