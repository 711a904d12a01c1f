"""`countdown`: one line, reach a target from given numbers; verified in the sandbox.

Prompt ``"Q: make {target} from {n1} {n2} {n3}\\nA: "`` (`n_numbers` numbers, 2..4, each
1..`max_number`, repeats allowed); the reference is one solution with no spaces, e.g.
``"Q: make 10 from 2 3 4\\nA: "`` -> ``"3*4-2"``. Instances are built from a random
expression tree over a random permutation of the numbers with + - *, printed with the
fewest parentheses; targets outside 1..`max_target` are redrawn.

An answer earns 1 iff it contains only digits, ``+ - * / ( )`` and spaces, uses exactly the
multiset of given numbers, and evaluates to the target (exactly, with fractions). The cheap
syntactic checks run in-process; only well-formed candidates go to the sandbox, which runs
`EVALUATOR` with ``{"expr": ...}`` as JSON on stdin: a restricted AST walk that prints
``{"num": p, "den": q}``. A sandbox that cannot run at all raises `SandboxError`, which is
an infrastructure failure and propagates; failed or malformed child output earns 0.
"""

from __future__ import annotations

import json
import random
import re
from fractions import Fraction
from typing import Protocol

from marlaas.envs.base import Env, Example
from marlaas.envs.tasks.common import (
    Candidate,
    GeneratedFamily,
    SingleTurnEnv,
    check_range,
    meta_field,
)
from marlaas.errors import DataError

_ALLOWED = re.compile(r"[0-9+\-*/() ]+")
_MAX_ANSWER_CHARS = 100
_PRECEDENCE = {"+": 1, "-": 1, "*": 2}
_LEAF = 3

#: The program the sandbox runs; self-contained (the sandbox need not see marlaas).
EVALUATOR = """\
import ast, json, sys
from fractions import Fraction

OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}

def ev(node):
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = ev(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        return OPS[type(node.op)](ev(node.left), ev(node.right))
    raise ValueError("disallowed syntax: " + type(node).__name__)

try:
    expr = json.loads(sys.stdin.read())["expr"]
    value = ev(ast.parse(expr, mode="eval").body)
    print(json.dumps({"num": value.numerator, "den": value.denominator}))
except (ValueError, TypeError, KeyError, SyntaxError, ZeroDivisionError, RecursionError) as exc:
    print(json.dumps({"error": type(exc).__name__}))
"""


class SandboxResultLike(Protocol):
    @property
    def ok(self) -> bool: ...

    @property
    def stdout(self) -> str: ...


class SandboxLike(Protocol):
    """What countdown needs of `marlaas.envs.sandbox.Sandbox`."""

    async def run_python(self, code: str, *, stdin: str = ...) -> SandboxResultLike: ...


def render(numbers: list[int], rng: random.Random) -> tuple[str, int, int]:
    """A random expression over `numbers` in order: (text, value, precedence of its root)."""
    if len(numbers) == 1:
        return str(numbers[0]), numbers[0], _LEAF
    cut = rng.randint(1, len(numbers) - 1)
    left, lv, lp = render(numbers[:cut], rng)
    right, rv, rp = render(numbers[cut:], rng)
    op = rng.choice("+-*")
    prec = _PRECEDENCE[op]
    if lp < prec:
        left = f"({left})"
    if rp < prec or (rp == prec and op == "-"):
        right = f"({right})"
    value = lv + rv if op == "+" else lv - rv if op == "-" else lv * rv
    return f"{left}{op}{right}", value, prec


def syntax_ok(answer: str, numbers: list[int]) -> bool:
    """The in-process checks: allowed characters, no ** or //, the exact number multiset."""
    if len(answer) > _MAX_ANSWER_CHARS or not _ALLOWED.fullmatch(answer):
        return False
    if "**" in answer or "//" in answer:
        return False
    tokens = re.findall(r"\d+", answer)
    if any(t != str(int(t)) for t in tokens):  # leading zeros are not Python literals
        return False
    return sorted(int(t) for t in tokens) == sorted(numbers)


def parse_value(stdout: str) -> Fraction | None:
    try:
        row = json.loads(stdout.strip().splitlines()[-1])
        return Fraction(int(row["num"]), int(row["den"]))
    except (ValueError, KeyError, TypeError, IndexError, ZeroDivisionError):
        return None


class CountdownEnv(SingleTurnEnv):
    def __init__(self, example: Example, *, family: CountdownFamily) -> None:
        super().__init__(example)
        self._family = family
        numbers = meta_field(example, "numbers")
        target = meta_field(example, "target")
        if not isinstance(numbers, list | tuple) or not isinstance(target, int):
            raise DataError(f"example {example.id!r}: meta numbers/target malformed")
        self._numbers = [int(x) for x in numbers]
        self._target = target

    async def score(self, answer: str) -> tuple[float, dict[str, float]]:
        if not syntax_ok(answer, self._numbers):
            return 0.0, {"sandbox_calls": 0.0}
        result = await self._family.sandbox.run_python(
            EVALUATOR, stdin=json.dumps({"expr": answer})
        )
        value = parse_value(result.stdout) if result.ok else None
        return (1.0 if value == self._target else 0.0), {"sandbox_calls": 1.0}


class CountdownFamily(GeneratedFamily):
    name = "countdown"
    max_turns = 1

    def __init__(
        self,
        *,
        tool_latency_s: tuple[float, float] = (0.0, 0.0),
        eval_fraction: float = 0.2,
        n_numbers: int = 3,
        max_number: int = 12,
        max_target: int = 150,
        sandbox: SandboxLike | None = None,
    ) -> None:
        super().__init__(tool_latency_s=tool_latency_s, eval_fraction=eval_fraction)
        self.n_numbers = check_range("n_numbers", n_numbers, 2, 4)
        self.max_number = check_range("max_number", max_number, 1, 99)
        self.max_target = check_range("max_target", max_target, 1, 10_000)
        self._sandbox = sandbox

    @property
    def sandbox(self) -> SandboxLike:
        """The sandbox; the default one is made on first use, because building examples
        and demonstrations (supervised warm-up) never needs it."""
        if self._sandbox is None:
            from marlaas.envs.sandbox import default_sandbox

            self._sandbox = default_sandbox()
        return self._sandbox

    def draw(self, rng: random.Random) -> Candidate:
        while True:
            numbers = [rng.randint(1, self.max_number) for _ in range(self.n_numbers)]
            order = rng.sample(numbers, len(numbers))
            expression, target, _ = render(order, rng)
            if 1 <= target <= self.max_target:
                break
        key = f"{target}:{','.join(map(str, sorted(numbers)))}"
        return Candidate(
            key=key,
            question=f"make {target} from {' '.join(map(str, numbers))}",
            reference=expression,
            meta={"numbers": numbers, "target": target},
        )

    def make_env(self, example: Example) -> Env:
        return CountdownEnv(example, family=self)
