"""The agent loop: one environment episode played through the rollout engine.

Each model turn is one engine request continuing the episode's context; its tokens and
behaviour log-probs are recorded with loss mask 1. Environment observations (tool
output) are appended with loss mask 0 and log-prob 0. A text prompt gets BOS as the
tokenizer expects; a chat env's prompt is template-rendered text (its own special
tokens), and its turns end at the end-of-turn token instead of a newline. All turns of an episode but the
last one it may take share one engine session, so the engine keeps the episode's KV
cache between turns (and a single-turn episode keeps none).

The loop never blocks: the engine and the environment are both awaited.
"""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace

from transformers import PreTrainedTokenizerBase

from marlaas.envs.base import TURN_END, Env
from marlaas.model.chat import encode_rendered, encode_text
from marlaas.rollout.lru import TokenLRU
from marlaas.types import (
    Completion,
    FinishReason,
    RolloutRequest,
    SamplingParams,
    Trajectory,
    unique_id,
)

#: How the episode reaches the engine: `RolloutEngine.submit`, or anything shaped like it.
Submit = Callable[[RolloutRequest], Awaitable[Completion]]


def with_stops(sampling: SamplingParams, stops: Sequence[str]) -> SamplingParams:
    """`sampling` that also stops at `stops` (each once, the request's own first)."""
    stop = tuple(dict.fromkeys((*sampling.stop, *stops)))
    return sampling if stop == sampling.stop else replace(sampling, stop=stop)


#: How many prompt texts, and how many of their tokens, `encode_prompt` keeps per tokenizer.
PROMPTS_KEPT = 4096
PROMPT_TOKENS_KEPT = 1 << 20

_encoded: weakref.WeakKeyDictionary[
    PreTrainedTokenizerBase, TokenLRU[tuple[bool, str], tuple[int, ...]]
] = weakref.WeakKeyDictionary()


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, *, chat: bool) -> tuple[int, ...]:
    """An episode's prompt ids (`encode_rendered` for chat environments, `encode_text`
    otherwise), remembered per tokenizer (the G episodes of a group, their retries and
    every eval share their prompts, and a tokenizer call costs the event loop tens of
    microseconds)."""
    kept = _encoded.get(tokenizer)
    if kept is None:
        kept = _encoded[tokenizer] = TokenLRU(PROMPTS_KEPT, PROMPT_TOKENS_KEPT)
    ids = kept.get((chat, text))
    if ids is None:
        ids = tuple((encode_rendered if chat else encode_text)(tokenizer, text))
        kept.put((chat, text), ids, len(ids))
    return ids


async def run_episode(
    submit: Submit,
    tokenizer: PreTrainedTokenizerBase,
    env: Env,
    *,
    tenant: str,
    example_id: str,
    sampling: SamplingParams,
    version: int | None = None,
) -> Trajectory:
    """Play `env` to the end with `tenant`'s adapter; returns the finished trajectory.

    `version=None` samples every turn with the tenant's newest adapter at that moment;
    the trajectory records the oldest and newest versions used.
    """
    prompt = await env.initial_observation()
    prompt_ids = encode_prompt(tokenizer, prompt, chat=env.chat)
    session = f"{tenant}/episode-{unique_id()}"
    turn_end = "" if env.chat else TURN_END
    # A plain-text turn always ends at a newline; every turn at the environment's stops.
    sampling = with_stops(sampling, env.stop if env.chat else (TURN_END, *env.stop))
    tokens: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    text: list[str] = [prompt]
    versions: list[int] = []
    reward = 0.0
    finish: FinishReason = "length"
    turns = 0
    for turns in range(1, env.max_turns + 1):
        request = RolloutRequest(
            tenant=tenant,
            prompt_ids=prompt_ids + tuple(tokens),
            sampling=sampling,
            version=version,
            # The last turn has no next one to continue its cache: keep nothing.
            session=session if turns < env.max_turns else None,
        )
        completion = await submit(request)
        versions.append(completion.version)
        tokens.extend(completion.token_ids)
        mask.extend([1] * len(completion.token_ids))
        logprobs.extend(completion.logprobs)
        text.append(completion.text + turn_end)
        finish = completion.finish_reason
        result = await env.step(completion.text)
        if result.done:
            reward = result.reward
            break
        if turns == env.max_turns:
            break  # still talking after the last turn: reward 0
        observation = result.observation or ""
        obs_ids = encode_rendered(tokenizer, observation)
        tokens.extend(obs_ids)
        mask.extend([0] * len(obs_ids))
        logprobs.extend([0.0] * len(obs_ids))
        text.append(observation)
    return Trajectory(
        tenant=tenant,
        example_id=example_id,
        prompt_ids=prompt_ids,
        token_ids=tuple(tokens),
        loss_mask_T=tuple(mask),
        logprobs_T=tuple(logprobs),
        reward=float(reward),
        min_version=min(versions),
        max_version=max(versions),
        turns=turns,
        finish_reason=finish,
        text="".join(text),
    )
