"""`reverse`: one line, reverse a word.

Prompt ``"Q: reverse {word}\\nA: "`` with a random lowercase word (letters a-z) of
`min_len`..`max_len` letters (3..10 by default, length drawn uniformly); the reference is
the word reversed, e.g. ``"Q: reverse hello\\nA: "`` -> ``"olleh"``. Reward 1 iff the
stripped answer line equals the reference.
"""

from __future__ import annotations

import random
import string

from marlaas.envs.base import Env, Example
from marlaas.envs.tasks.common import Candidate, GeneratedFamily, SingleTurnEnv, check_range
from marlaas.errors import ConfigError


class ReverseFamily(GeneratedFamily):
    name = "reverse"
    max_turns = 1

    def __init__(
        self,
        *,
        tool_latency_s: tuple[float, float] = (0.0, 0.0),
        eval_fraction: float = 0.2,
        min_len: int = 3,
        max_len: int = 10,
    ) -> None:
        super().__init__(tool_latency_s=tool_latency_s, eval_fraction=eval_fraction)
        self.min_len = check_range("min_len", min_len, 1, 64)
        self.max_len = check_range("max_len", max_len, 1, 64)
        if max_len < min_len:
            raise ConfigError(f"max_len ({max_len}) must be >= min_len ({min_len})")

    def draw(self, rng: random.Random) -> Candidate:
        length = rng.randint(self.min_len, self.max_len)
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(length))
        return Candidate(
            key=word, question=f"reverse {word}", reference=word[::-1], meta={"word": word}
        )

    def make_env(self, example: Example) -> Env:
        return SingleTurnEnv(example)
