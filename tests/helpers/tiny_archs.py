"""Tiny random-weight decoders of the architectures whose attention differs from Llama's:
sliding windows on every layer (Mistral), on some layers (Qwen2 / Qwen3 with
`use_sliding_window`, Gemma2, Gemma3), logit soft-capping and query scaling (Gemma2).

2 layers, hidden 64, and a window (`WINDOW`) shorter than the tests' sequences, so a
wrong window changes the logits. A plain module (imported by tests in several folders).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from marlaas.model.tokenizer import build_tokenizer

WINDOW = 6
ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")
_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
}
_SPECIFIC: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": WINDOW},
    # Layers from `max_window_layers` on are sliding: layer 0 full, layer 1 sliding.
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    "qwen3": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    "gemma2": {
        "sliding_window": WINDOW,
        "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 20.0,
        "final_logit_softcapping": 15.0,
    },
    "gemma3_text": {
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 24,
    },
}


def tiny_config(arch: str, vocab: int) -> PretrainedConfig:
    tokenizer = build_tokenizer()
    return AutoConfig.for_model(
        arch,
        **_COMMON,
        **_SPECIFIC[arch],
        vocab_size=vocab,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )


def tiny_model(arch: str, vocab: int, seed: int = 0) -> PreTrainedModel:
    """A seeded float32 model in eval mode, its output head sharpened (fewer near-ties)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, vocab), dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    return model.eval()


def save_tiny(arch: str, path: Path) -> Path:
    """`tiny_model(arch)` with the byte-level tokenizer, saved as a model directory."""
    tokenizer = build_tokenizer()
    tiny_model(arch, len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(str(path))
    return path
