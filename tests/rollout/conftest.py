"""A tiny random Llama with the byte-level tokenizer, saved and loaded, for engine tests.

float32 and seeded. One `LoRAModel` per process wraps the loaded base (the multi-LoRA
layers are injected once); each test gets a fresh `AdapterBank` with random, non-zero
adapters, so an engine that ignored a row's adapter would fail the comparisons.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from rollout_support import BASE_SPEC, MAX_POSITIONS, SPEC, random_adapter
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from marlaas.model.bank import AdapterBank
from marlaas.model.base import load_base
from marlaas.model.lora import LoRAModel
from marlaas.model.tokenizer import build_tokenizer
from marlaas.rollout import RolloutEngine

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=MAX_POSITIONS,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # a sharper random model: fewer near-ties between logits
        model.lm_head.weight.mul_(8.0)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tokenizer(tiny_dir: Path) -> PreTrainedTokenizerBase:
    return load_base(tiny_dir)[1]


@pytest.fixture(scope="session")
def lora_model(tiny_dir: Path) -> LoRAModel:
    base, _ = load_base(tiny_dir)
    return LoRAModel(base, max_rank=8, target_modules=SPEC.target_modules)


@pytest.fixture(scope="session")
def fresh_base(tiny_dir: Path) -> Callable[[], PreTrainedModel]:
    """A plain Hugging Face copy of the base (no multi-LoRA layers), for references."""

    def make() -> PreTrainedModel:
        model = LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
        return model.eval()

    return make


@pytest.fixture
def bank(lora_model: LoRAModel) -> AdapterBank:
    """Tenants t0, t1, t2 (random adapters, seeds 10, 11, 12) and 'base' (rank 0)."""
    b = AdapterBank(lora_model, num_slots=6, versions_kept=3)
    for i in range(3):
        b.register(f"t{i}", SPEC, tensors=random_adapter(lora_model, 10 + i))
    b.register("base", BASE_SPEC)
    return b


@pytest.fixture
def make_engine(
    lora_model: LoRAModel, bank: AdapterBank, tokenizer: PreTrainedTokenizerBase
) -> Callable[..., RolloutEngine]:
    def make(**kwargs: object) -> RolloutEngine:
        return RolloutEngine(lora_model, bank, tokenizer, **kwargs)  # type: ignore[arg-type]

    return make
