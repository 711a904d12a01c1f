"""`marlaas base eval`: per-family held-out accuracy of a base model (no adapter).

Episodes are played turn by turn over a batch: every active episode's next turn is
generated in one batched Hugging Face `generate` call, the environments answer
concurrently, and finished episodes leave the batch. This is the plain-HF reference
path; the multi-tenant rollout engine is measured against it elsewhere.

Batches are left-padded whatever the tokenizer's own `padding_side` (a right-padded
batch would generate after its padding), with the tokenizer's pad token (else its EOS),
and prompts get BOS as the tokenizer expects (`marlaas.model.chat.encode_text`), as
in training.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from marlaas.envs.base import TURN_END, Env
from marlaas.envs.tasks import FAMILIES, get_family
from marlaas.model.chat import encode_text


@dataclass(frozen=True)
class FamilyAccuracy:
    family: str
    episodes: int
    greedy: float
    sampled: float


def generate_turns(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    contexts: Sequence[str],
    *,
    temperature: float,
    max_new_tokens: int,
) -> list[str]:
    """One model turn per context: the text up to (not including) the first newline."""
    newline_id = tokenizer(TURN_END, add_special_tokens=False)["input_ids"][-1]
    enc = left_padded(tokenizer, [encode_text(tokenizer, c) for c in contexts])
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None,
        top_k=None,
        top_p=None,
        eos_token_id=[newline_id, tokenizer.eos_token_id],
        pad_token_id=pad_id(tokenizer),
    )
    enc = {k: v.to(model.device) for k, v in enc.items()}
    with torch.no_grad():
        out = model.generate(**enc, generation_config=config)  # type: ignore[operator]
    new = out[:, enc["input_ids"].shape[1] :]
    texts = tokenizer.batch_decode(new, skip_special_tokens=True)
    return [t.split(TURN_END, 1)[0] for t in texts]


def pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id that pads a batch: the pad token, else EOS (GPT-2, Llama 3 have no pad)."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if isinstance(candidate, int):
            return candidate
    return 0


def left_padded(
    tokenizer: PreTrainedTokenizerBase, rows: Sequence[Sequence[int]]
) -> dict[str, torch.Tensor]:
    """`input_ids` and `attention_mask` of `rows`, padded on the left."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id(tokenizer), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = torch.tensor(list(row), dtype=torch.long)
            mask[i, width - len(row) :] = 1
    return {"input_ids": ids, "attention_mask": mask}


async def play_episodes(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    envs: Sequence[Env],
    *,
    temperature: float,
    max_new_tokens: int = 48,
) -> list[float]:
    """Play one episode per env to the end; returns each episode's reward."""
    contexts = list(await asyncio.gather(*(env.initial_observation() for env in envs)))
    rewards: list[float | None] = [None] * len(envs)
    turns = [0] * len(envs)
    active = list(range(len(envs)))
    while active:
        actions = generate_turns(
            model,
            tokenizer,
            [contexts[i] for i in active],
            temperature=temperature,
            max_new_tokens=max_new_tokens,
        )
        results = await asyncio.gather(
            *(envs[i].step(a) for i, a in zip(active, actions, strict=True))
        )
        still: list[int] = []
        for i, action, res in zip(active, actions, results, strict=True):
            turns[i] += 1
            if res.done:
                rewards[i] = res.reward
            elif turns[i] >= envs[i].max_turns:
                rewards[i] = 0.0
            else:
                contexts[i] += action + TURN_END + (res.observation or "")
                still.append(i)
        active = still
    return [r if r is not None else 0.0 for r in rewards]


async def evaluate_base(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    families: Sequence[str] = tuple(FAMILIES),
    *,
    episodes: int = 100,
    seed: int = 0,
    batch_size: int = 100,
    temperature: float = 1.0,
) -> list[FamilyAccuracy]:
    """Greedy and sampled accuracy on each family's eval split."""
    scores: list[FamilyAccuracy] = []
    for name in families:
        family = get_family(name)
        examples = family.examples("eval", episodes, seed=seed)
        accuracy: dict[float, float] = {}
        for temp in (0.0, temperature):
            torch.manual_seed(seed)
            rewards: list[float] = []
            for start in range(0, len(examples), batch_size):
                chunk = examples[start : start + batch_size]
                envs = [family.make_env(ex) for ex in chunk]
                rewards += await play_episodes(model, tokenizer, envs, temperature=temp)
            accuracy[temp] = sum(rewards) / len(rewards)
        scores.append(FamilyAccuracy(name, len(examples), accuracy[0.0], accuracy[temperature]))
    return scores


def as_json(scores: Sequence[FamilyAccuracy]) -> dict[str, object]:
    return {"families": [asdict(s) for s in scores]}
