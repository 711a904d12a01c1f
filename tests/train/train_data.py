"""Helpers for the trainer tests: a tiny seeded random Llama and synthetic GRPO data.

Everything is float32 and seeded, so comparisons are deterministic. Trajectories are
non-trivial on purpose: random tokens, prompts of different lengths, a tool-output
stretch in the middle of some completions (loss mask 0), rewards that give non-zero
advantages, and behaviour log-probs a little off the current policy so that ratios
differ from 1 and some tokens are clipped.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from marlaas.config.specs import GRPOSpec
from marlaas.model.lora import LoRAModel
from marlaas.train.batch import TrainBatch
from marlaas.train.losses import token_logprobs
from marlaas.types import Trajectory

torch.set_num_threads(1)

VOCAB = 128
TINY: dict[str, Any] = {
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
    "tie_word_embeddings": False,
}


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    model.eval()
    return model


def make_batch(
    tenant: str,
    step: int,
    algo: GRPOSpec,
    seed: int,
    *,
    model: LoRAModel | None = None,
    temperature: float = 1.0,
    noise: float = 0.3,
    prompt_len: tuple[int, int] = (3, 9),
    completion_len: tuple[int, int] = (4, 14),
    staleness: int = 0,
) -> TrainBatch:
    """A GRPO batch of `algo.prompts_per_step` groups of `algo.group_size` trajectories.

    With `model`, behaviour log-probs are the base's log-probs plus Gaussian noise of
    scale `noise` (so ratios are near 1 but not equal); without it, random values.
    """
    g = torch.Generator().manual_seed(seed)
    groups: list[list[Trajectory]] = []
    for p in range(algo.prompts_per_step):
        prompt = torch.randint(
            4, VOCAB, (int(torch.randint(*prompt_len, (1,), generator=g)),), generator=g
        )
        group: list[Trajectory] = []
        for i in range(algo.group_size):
            n = int(torch.randint(*completion_len, (1,), generator=g))
            tokens = torch.randint(4, VOCAB, (n,), generator=g)
            mask = torch.ones(n, dtype=torch.long)
            if n >= 8 and i % 2 == 0:  # a tool observation in the middle
                mask[n // 2 - 1 : n // 2 + 2] = 0
            if model is not None:
                full = torch.cat([prompt, tokens])[None]
                with torch.no_grad():
                    logits = model.base(input_ids=full[:, :-1]).logits
                lp = token_logprobs(logits, full[:, 1:], temperature)[0, len(prompt) - 1 :]
            else:
                lp = -torch.rand(n, generator=g) * 5
            lp = lp + noise * torch.randn(n, generator=g)
            lp = torch.where(mask.bool(), lp, 0.0)
            group.append(
                Trajectory(
                    tenant=tenant,
                    example_id=f"{tenant}-{step}-{p}",
                    prompt_ids=tuple(prompt.tolist()),
                    token_ids=tuple(tokens.tolist()),
                    loss_mask_T=tuple(mask.tolist()),
                    logprobs_T=tuple(lp.tolist()),
                    reward=float(torch.rand((), generator=g) < 0.5) + 0.1 * i,
                    min_version=max(0, step - staleness),
                    max_version=step,
                    turns=1,
                    finish_reason="stop",
                )
            )
        groups.append(group)
    return TrainBatch.from_groups(tenant, step, groups, scale_rewards=algo.scale_rewards)
