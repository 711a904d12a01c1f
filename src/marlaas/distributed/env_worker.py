"""`EnvWorker`: the environment worker actor (CPU). An episode's `Env` lives in the
worker from `start` to its last `step`. A restarted worker is a new incarnation with no
episodes: `step` on an episode it does not hold raises `EpisodeLost`, which the client
turns into a retry of the whole episode (`envs.py`). Imports no torch."""

from __future__ import annotations

import uuid
from collections import OrderedDict
from typing import Any

from marlaas.distributed.records import MAX_EPISODES, ActorInfo, EpisodeLost, actor_info
from marlaas.envs.base import Env, Example, StepResult, TaskFamily


class EnvWorker:
    """Runs environment episodes on a CPU worker (see the module docstring)."""

    def __init__(self) -> None:
        self.incarnation = uuid.uuid4().hex
        self._families: dict[str, TaskFamily] = {}
        self._episodes: OrderedDict[str, Env] = OrderedDict()

    async def info(self) -> ActorInfo:
        return actor_info(self.incarnation)

    async def start(
        self, family_key: str, family_box: list[Any], example: Example, episode_id: str
    ) -> str:
        """Create the episode's environment; returns its initial observation.
        `family_box` holds the object ref of the task family (fetched once per worker)."""
        family = self._families.get(family_key)
        if family is None:
            family = await family_box[0]
            self._families[family_key] = family
        env = family.make_env(example)
        self._episodes[episode_id] = env
        while len(self._episodes) > MAX_EPISODES:
            self._episodes.popitem(last=False)
        try:
            return await env.initial_observation()
        except BaseException:
            self._episodes.pop(episode_id, None)
            raise

    async def step(self, episode_id: str, action: str) -> StepResult:
        env = self._episodes.get(episode_id)
        if env is None:
            raise EpisodeLost(
                f"episode {episode_id} is not held by this environment worker (it restarted)"
            )
        try:
            result = await env.step(action)
        except BaseException:
            self._episodes.pop(episode_id, None)
            raise
        if result.done:
            self._episodes.pop(episode_id, None)
        return result

    async def end(self, episode_id: str) -> None:
        self._episodes.pop(episode_id, None)

    async def episodes(self) -> int:
        return len(self._episodes)
