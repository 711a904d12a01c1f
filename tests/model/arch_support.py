"""Tiny random models of each decoder architecture marlaas supports, built from a config
here (2 layers, hidden 64) and saved with the tests' character tokenizer.

Sliding-window architectures (Mistral, Gemma2, Gemma3) have their window switched off
in these configs; `WINDOWED` holds their default configs, with windows, which marlaas
runs too (`tests/rollout/test_engine_architectures.py` checks the engine's logits on them).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers as hf
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerFast

VOCAB = 128
_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3, "vocab_size": VOCAB}
_COMMON = {
    **_IDS,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 128,
}
_GQA = {**_COMMON, "num_key_value_heads": 2}
_FULL = {"layer_types": ["full_attention", "full_attention"]}


def _configs() -> dict[str, Callable[[], PretrainedConfig]]:
    return {
        "llama": lambda: hf.LlamaConfig(**_GQA),
        "qwen2": lambda: hf.Qwen2Config(**_GQA),
        "qwen3": lambda: hf.Qwen3Config(**_GQA, head_dim=16),
        "mistral": lambda: hf.MistralConfig(**_GQA, sliding_window=None),
        "gemma2": lambda: hf.Gemma2Config(**_GQA, head_dim=16, **_FULL),
        "gemma3": lambda: hf.Gemma3TextConfig(**_GQA, head_dim=16, **_FULL),
        "phi3": lambda: hf.Phi3Config(**_GQA),
        "gpt_neox": lambda: hf.GPTNeoXConfig(**_COMMON),
        "mixtral": lambda: hf.MixtralConfig(**_GQA, num_local_experts=4, num_experts_per_tok=2),
        "opt": lambda: hf.OPTConfig(
            **_IDS,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=128,
            word_embed_proj_dim=64,
            max_position_embeddings=128,
        ),
        "qwen2_moe": lambda: hf.Qwen2MoeConfig(
            **_GQA,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
        ),
        "gpt2": lambda: hf.GPT2Config(
            **_IDS, n_embd=64, n_layer=2, n_head=4, n_positions=128, n_inner=128
        ),
    }


CONFIGS = _configs()
ARCHS = tuple(CONFIGS)

#: Default configs with sliding windows on, and the config option that sets the window.
WINDOWED: dict[str, tuple[Callable[[], PretrainedConfig], str]] = {
    "mistral": (lambda: hf.MistralConfig(**_GQA), "sliding_window: null"),
    "gemma2": (lambda: hf.Gemma2Config(**_GQA, head_dim=16), "layer_types"),
    "gemma3": (lambda: hf.Gemma3TextConfig(**_GQA, head_dim=16), "layer_types"),
    "qwen2": (
        lambda: hf.Qwen2Config(**_GQA, use_sliding_window=True, max_window_layers=1),
        "use_sliding_window: false",
    ),
}


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; ids 0-3 are <unk>, <s>, </s>, <pad>."""
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    chars = [chr(c) for c in range(33, 33 + VOCAB - len(specials))]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )


def save_model(config: PretrainedConfig, path: Path, tokenizer: Any, seed: int = 0) -> Path:
    """A random-weight model of `config` saved (float32) with `tokenizer` under `path`."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
