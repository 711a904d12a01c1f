"""`arithmetic`: one line, integer arithmetic.

Prompt ``"Q: {a}{op}{b}\\nA: "`` with op in ``+ - *`` (no spaces), e.g. ``"Q: 37+485\\nA: "``;
the reference is the exact integer result (``"522"``, or ``"-12"`` for a negative
difference). Reward 1 iff the stripped answer line equals the reference.

Difficulty is mixed: for + and - each operand has 1..`max_digits` digits (the digit count
drawn uniformly), for * each factor has 1..`max_mul_digits` digits. The defaults (2 and 1)
are sized so the embedded base is partially competent; raise them for harder jobs
(`options: {max_digits: 4, max_mul_digits: 3}`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from marlaas.envs.base import Env, Example
from marlaas.envs.tasks.common import Candidate, GeneratedFamily, SingleTurnEnv, check_range
from marlaas.errors import ConfigError

_OPS = ("+", "-", "*")


def random_number(rng: random.Random, max_digits: int) -> int:
    """A number whose digit count is uniform in 1..max_digits (0 counts as one digit)."""
    digits = rng.randint(1, max_digits)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


class ArithmeticFamily(GeneratedFamily):
    name = "arithmetic"
    max_turns = 1

    def __init__(
        self,
        *,
        tool_latency_s: tuple[float, float] = (0.0, 0.0),
        eval_fraction: float = 0.2,
        max_digits: int = 2,
        max_mul_digits: int = 1,
        ops: Sequence[str] = _OPS,
    ) -> None:
        super().__init__(tool_latency_s=tool_latency_s, eval_fraction=eval_fraction)
        self.max_digits = check_range("max_digits", max_digits, 1, 9)
        self.max_mul_digits = check_range("max_mul_digits", max_mul_digits, 1, 9)
        if not ops or any(op not in _OPS for op in ops):
            raise ConfigError(f"ops must be a non-empty subset of {_OPS}, got {ops!r}")
        self.ops = tuple(ops)

    def draw(self, rng: random.Random) -> Candidate:
        op = rng.choice(self.ops)
        digits = self.max_mul_digits if op == "*" else self.max_digits
        a, b = random_number(rng, digits), random_number(rng, digits)
        value = a + b if op == "+" else a - b if op == "-" else a * b
        question = f"{a}{op}{b}"
        return Candidate(
            key=question,
            question=question,
            reference=str(value),
            meta={"a": a, "b": b, "op": op},
        )

    def make_env(self, example: Example) -> Env:
        return SingleTurnEnv(example)
