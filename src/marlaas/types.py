"""Records that cross stage boundaries. One record per boundary; no wide dicts.

Token-level arrays are plain tuples here so that records are cheap to pickle across
processes and Ray; the trainer turns them into tensors. Suffixes follow the notation
of the whole code base: `_T` is a per-token sequence.
"""

from __future__ import annotations

import itertools
import os
import secrets
from dataclasses import dataclass, field
from typing import Literal

from marlaas.errors import DataError

FinishReason = Literal["stop", "eos", "length", "aborted"]


class _UniqueIds:
    """Ids unique across processes without a shared counter: a random prefix drawn per
    process (again in a forked child) and a counter."""

    def __init__(self) -> None:
        self.draw()
        os.register_at_fork(after_in_child=self.draw)

    def draw(self) -> None:
        self.prefix = secrets.token_hex(6)
        self.counter = itertools.count()

    def next(self) -> str:
        return f"{self.prefix}{next(self.counter):x}"


_ids = _UniqueIds()


def unique_id() -> str:
    """A fresh id, unique across processes and runs (a uuid4 costs the event loop a
    system call per request)."""
    return _ids.next()


def next_request_id() -> str:
    """A fresh request id (`unique_id`)."""
    return f"req-{unique_id()}"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. `temperature == 0` is greedy. Log-probs are always those of
    `log_softmax(logits / temperature)` (1.0 when greedy), before top-k/top-p: the same
    quantity the trainer recomputes, so importance ratios are exact. `prompt_logprobs`
    also asks for the prompt's own log-probs (`Completion.prompt_logprobs`)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 48
    stop: tuple[str, ...] = ()
    seed: int | None = None
    prompt_logprobs: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0 or self.max_new_tokens < 1:
            raise ValueError("top_k must be >= 0 and max_new_tokens >= 1")

    @property
    def logprob_temperature(self) -> float:
        return self.temperature if self.temperature > 0 else 1.0


@dataclass(frozen=True)
class RolloutRequest:
    """Ask the rollout engine for one continuation of `prompt_ids` under a tenant's adapter.

    `version=None` samples with the tenant's newest published version at admission.
    `session` names a multi-turn episode: when the engine still holds the KV cache of
    that session's previous turn and `prompt_ids` extends it, only the new tokens are
    prefilled. `account` names the tenant whose fair share of the sampler the request
    is queued and charged under when that is not `tenant` (work of one tenant sampled
    with another adapter: a training job's judge calling the base); None: `tenant`.
    """

    tenant: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    version: int | None = None
    session: str | None = None
    request_id: str = field(default_factory=next_request_id)
    account: str | None = None

    @property
    def share(self) -> str:
        """The tenant whose fair share the request uses (`account`, else `tenant`)."""
        return self.account if self.account is not None else self.tenant


@dataclass(frozen=True)
class Completion:
    """The engine's answer: the new tokens, their behaviour log-probs and the policy used.

    `prompt_logprobs[i]` is log p(prompt[i] | prompt[:i]) at temperature 1 (entry 0 is
    0.0), when the request asked for it (`SamplingParams.prompt_logprobs`); else None.
    """

    request_id: str
    tenant: str
    version: int
    prompt_len: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    finish_reason: FinishReason
    prompt_logprobs: tuple[float, ...] | None = None


@dataclass(frozen=True)
class Trajectory:
    """One finished episode, ready for the trainer.

    `token_ids` is the whole context after the prompt: model turns and observations,
    interleaved. `loss_mask_T` is 1 on model-written tokens only. `logprobs_T` holds the
    behaviour log-probs on model tokens (0.0 elsewhere). `min_version` is the oldest
    adapter version that sampled any of its turns (what staleness is measured against).
    """

    tenant: str
    example_id: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    loss_mask_T: tuple[int, ...]
    logprobs_T: tuple[float, ...]
    reward: float
    min_version: int
    max_version: int
    turns: int
    finish_reason: FinishReason
    text: str = ""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.loss_mask_T) != n or len(self.logprobs_T) != n:
            raise ValueError("token_ids, loss_mask_T and logprobs_T must have equal lengths")


@dataclass(frozen=True)
class Datum:
    """One row of training data for a `forward_backward` or `forward` call.

    The model reads `input_ids`; position `t` is scored on `target_ids[t]` (next-token
    data has `target_ids == input_ids[1:] + (next,)`) with weight `weights_T[t]` in the
    loss, a plain weighted sum (see `marlaas.train.objectives`). A weight of 0 means the
    position carries no loss (a prompt or tool-output token). `sampling_logprobs_T[t]`
    (the log-prob of `target_ids[t]` under the policy that sampled it) and
    `advantages_T[t]` are given when the loss needs them, else left empty.

    Rows of one tenant that start with the same tokens before their first weighted
    position share that prefix's forward in the trainer (a GRPO group's samples).
    """

    input_ids: tuple[int, ...]
    target_ids: tuple[int, ...]
    weights_T: tuple[float, ...]
    sampling_logprobs_T: tuple[float, ...] = ()
    advantages_T: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if n == 0:
            raise DataError("a datum needs at least one input token")
        if len(self.target_ids) != n or len(self.weights_T) != n:
            raise DataError(
                f"input_ids, target_ids and weights_T must have equal lengths, got {n}, "
                f"{len(self.target_ids)} and {len(self.weights_T)}"
            )
        for name in ("sampling_logprobs_T", "advantages_T"):
            got = len(getattr(self, name))
            if got not in (0, n):
                raise DataError(f"{name} must be empty or have {n} entries, got {got}")
