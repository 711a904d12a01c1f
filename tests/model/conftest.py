"""Tiny random Hugging Face causal LMs saved to disk, for the model-stage tests.

float32 and seeded, so every comparison is deterministic. The Qwen2 variant has biases on
q/k/v, which the multi-LoRA layers must keep (they wrap the base linear unchanged).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from arch_support import char_tokenizer
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from marlaas.config.specs import LoRASpec
from marlaas.model.lora import AdapterTensors, LoRAModel

torch.set_num_threads(1)

VOCAB = 128
_TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": VOCAB,
    "max_position_embeddings": 128,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
}


def _save(model: PreTrainedModel, path: Path) -> Path:
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**_TINY, tie_word_embeddings=False))
    return _save(model, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(Qwen2Config(**_TINY, tie_word_embeddings=True))
    return _save(model, tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(params=["llama", "qwen2"])
def tiny_dir(request: pytest.FixtureRequest) -> Path:
    """Each tiny architecture in turn."""
    return Path(request.getfixturevalue(f"tiny_{request.param}_dir"))


def random_adapter(
    model: LoRAModel, spec: LoRASpec, seed: int, scale: float = 0.2
) -> AdapterTensors:
    """An adapter with random A *and* B, so that a wrong computation changes the output."""
    g = torch.Generator().manual_seed(seed)
    out: AdapterTensors = {}
    for path, (A, B) in model.init_adapter(spec, seed).items():
        out[path] = (A, torch.randn(B.shape, generator=g) * scale)
    return out


@pytest.fixture
def make_adapter() -> Callable[[LoRAModel, LoRASpec, int], AdapterTensors]:
    return random_adapter
