"""A short RL loop written against the `tinker` SDK alone (nothing of marlaas is
imported here): what `examples/tinker_rl_loop.py` runs, what the tests check raises the
reward, and what `marlaas bench tinker` runs once per client.

The task is the built-in `reverse` family's, in plain Python: a prompt
`"Q: reverse {word}\\nA: "` of a random lowercase word, reward 1 when the first line of
the answer is the word reversed. Each step samples `group_size` answers to each of
`prompts_per_step` prompts from the current weights
(`save_weights_and_get_sampling_client`), centres each group's rewards (GRPO-style
advantages, no std scaling), and takes one `forward_backward` with the chosen policy
loss and one `optim_step`. Groups whose answers all scored the same teach nothing and
are left out, as in tinker-cookbook's `rl_loop`.
"""

from __future__ import annotations

import random
import string
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import tinker
from tinker import types


@dataclass(frozen=True)
class LoopConfig:
    steps: int = 20
    prompts_per_step: int = 8
    group_size: int = 8
    rank: int = 8
    learning_rate: float = 5e-4
    max_tokens: int = 16
    temperature: float = 1.0
    loss_fn: types.LossFnType = "importance_sampling"
    eval_prompts: int = 128
    seed: int = 0


@dataclass
class LoopResult:
    model_id: str
    accuracy_before: float
    accuracy_after: float
    #: Mean reward of each step's samples (before that step's update).
    rewards: list[float] = field(default_factory=list)
    tokens_sampled: int = 0
    tokens_trained: int = 0
    seconds: float = 0.0
    #: `tinker://.../sampler_weights/...` of the final weights, when asked to save them.
    saved_path: str | None = None


def reverse_prompt(rng: random.Random) -> tuple[str, str]:
    """A prompt of the `reverse` task and its answer."""
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 10)))
    return f"Q: reverse {word}\nA: ", word[::-1]


def _tensor(values: list[int] | list[float], dtype: types.TensorDtype) -> types.TensorData:
    return types.TensorData(data=values, dtype=dtype, shape=[len(values)])


def reward(text: str, answer: str) -> float:
    return 1.0 if text.split("\n", 1)[0].strip() == answer else 0.0


def _accuracy(
    sampler: tinker.SamplingClient, tok: Any, prompts: list[tuple[list[int], str]], max_tokens: int
) -> float:
    if not prompts:
        return float("nan")  # no held-out prompts: not measured
    greedy = types.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=["\n"])
    futures = [sampler.sample(types.ModelInput.from_ints(ids), 1, greedy) for ids, _ in prompts]
    scores = [
        reward(str(tok.decode(f.result().sequences[0].tokens)), answer)
        for f, (_, answer) in zip(futures, prompts, strict=True)
    ]
    return sum(scores) / len(scores)


def run_loop(
    service: tinker.ServiceClient,
    base_model: str,
    config: LoopConfig,
    log: Callable[[str], None] | None = None,
    save_as: str | None = None,
) -> LoopResult:
    """Train one LoRA adapter with `config`; greedy accuracy on held-out prompts
    before and after (NaN with `eval_prompts=0`), and each step's mean reward; with
    `save_as`, the final weights saved as sampler weights of that name."""
    start = time.perf_counter()
    training = service.create_lora_training_client(
        base_model=base_model, rank=config.rank, seed=config.seed
    )
    client = training.result()
    tok = client.get_tokenizer()
    rng = random.Random(config.seed)
    held_out = [reverse_prompt(random.Random(10_000 + i)) for i in range(config.eval_prompts)]
    eval_set = [(tok.encode(p), a) for p, a in held_out]
    params = types.SamplingParams(
        max_tokens=config.max_tokens, temperature=config.temperature, stop=["\n"]
    )
    adam = types.AdamParams(learning_rate=config.learning_rate, beta1=0.9, beta2=0.999, eps=1e-8)

    sampler = client.save_weights_and_get_sampling_client().result()
    result = LoopResult(client.model_id, _accuracy(sampler, tok, eval_set, config.max_tokens), 0.0)
    for step in range(config.steps):
        prompts = [reverse_prompt(rng) for _ in range(config.prompts_per_step)]
        encoded = [tok.encode(p) for p, _ in prompts]
        futures = [  # seeded: a run samples the same given the same weights
            sampler.sample(
                types.ModelInput.from_ints(ids),
                config.group_size,
                params.model_copy(update={"seed": config.seed * 1_000_003 + step * 1_009 + i}),
            )
            for i, ids in enumerate(encoded)
        ]
        data: list[types.Datum] = []
        rewards: list[float] = []
        for future, ids, (_, answer) in zip(futures, encoded, prompts, strict=True):
            sequences = future.result().sequences
            group = [reward(str(tok.decode(s.tokens)), answer) for s in sequences]
            rewards += group
            mean = sum(group) / len(group)
            result.tokens_sampled += sum(len(s.tokens) for s in sequences)
            if all(r == mean for r in group):
                continue  # no signal in this group
            for s, r in zip(sequences, group, strict=True):
                pad = len(ids) - 1
                tokens = ids + list(s.tokens)
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": _tensor(tokens[1:], "int64"),
                            "logprobs": _tensor([0.0] * pad + list(s.logprobs or []), "float32"),
                            "advantages": _tensor(
                                [0.0] * pad + [r - mean] * len(s.tokens), "float32"
                            ),
                        },
                    )
                )
                result.tokens_trained += len(tokens) - 1
        result.rewards.append(sum(rewards) / len(rewards))
        if data:
            fb = client.forward_backward(data, config.loss_fn)
            step_future = client.optim_step(adam)
            fb.result()
            step_future.result()
        sampler = client.save_weights_and_get_sampling_client().result()
        if log is not None:
            log(f"step {step}: reward {result.rewards[-1]:.3f} ({len(data)} rows trained)")
    result.accuracy_after = _accuracy(sampler, tok, eval_set, config.max_tokens)
    if save_as is not None:
        result.saved_path = client.save_weights_for_sampler(save_as).result().path
    result.seconds = time.perf_counter() - start
    return result
