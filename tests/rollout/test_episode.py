"""The agent loop: turns of one episode share an engine session, except a turn that
cannot be followed by another (the last allowed one, or the only one), which asks the
engine to keep no cache."""

from __future__ import annotations

import asyncio

import pytest
from transformers import PreTrainedTokenizerBase

from marlaas.envs.base import Env, StepResult
from marlaas.rollout.episode import run_episode
from marlaas.types import Completion, RolloutRequest, SamplingParams


class _Talk(Env):
    """Answers every turn with an observation until `done_after` turns."""

    def __init__(self, max_turns: int, done_after: int) -> None:
        self.max_turns = max_turns
        self.done_after = done_after
        self.turns = 0

    async def initial_observation(self) -> str:
        return "question:"

    async def step(self, action: str) -> StepResult:
        self.turns += 1
        if self.turns >= self.done_after:
            return StepResult(done=True, reward=1.0)
        return StepResult(done=False, observation=" obs")


@pytest.mark.parametrize(
    ("max_turns", "done_after", "sessions"),
    [(1, 1, [False]), (3, 3, [True, True, False]), (3, 2, [True, True]), (2, 9, [True, False])],
)
def test_only_turns_that_may_continue_keep_a_session(
    tokenizer: PreTrainedTokenizerBase, max_turns: int, done_after: int, sessions: list[bool]
) -> None:
    requests: list[RolloutRequest] = []

    async def submit(request: RolloutRequest) -> Completion:
        requests.append(request)
        return Completion(
            request_id=request.request_id,
            tenant=request.tenant,
            version=0,
            prompt_len=len(request.prompt_ids),
            token_ids=(5, 6),
            logprobs=(-0.1, -0.2),
            text="ab",
            finish_reason="stop",
        )

    env = _Talk(max_turns, done_after)
    trajectory = asyncio.run(
        run_episode(
            submit,
            tokenizer,
            env,
            tenant="t0",
            example_id="e",
            sampling=SamplingParams(max_new_tokens=4),
        )
    )
    assert [r.session is not None for r in requests] == sessions
    assert len({r.session for r in requests if r.session is not None}) <= 1
    assert trajectory.turns == len(sessions)
