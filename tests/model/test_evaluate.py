"""`marlaas base eval` batches turns left-padded whatever the tokenizer's padding side,
so a batched greedy turn is the turn the context gets alone."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from marlaas.model.evaluate import generate_turns
from marlaas.model.tokenizer import build_tokenizer

CONTEXTS = ["Q: 1+2\nA: ", "Q: reverse abcdef\nA: ", "Q: 7\nA: "]


def _model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=128,
        eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("with_pad", [True, False])
def test_batched_turns_equal_single_turns(side: str, with_pad: bool) -> None:
    tokenizer = build_tokenizer()
    model = _model(tokenizer)
    tokenizer.padding_side = side
    if not with_pad:  # GPT-2 and Llama 3 tokenizers have no pad token
        tokenizer.pad_token = None
    alone = [
        generate_turns(model, tokenizer, [c], temperature=0.0, max_new_tokens=6)[0]
        for c in CONTEXTS
    ]
    batched = generate_turns(model, tokenizer, CONTEXTS, temperature=0.0, max_new_tokens=6)
    assert batched == alone
    assert tokenizer.padding_side == side  # the tokenizer is left as it was
    assert any(alone)  # the model writes something, so the comparison can fail
