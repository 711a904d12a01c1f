"""`calculator`: multi-turn tool use with an in-process calculator (max_turns 3).

Question: an integer expression in words, operands joined by ``plus``, ``minus`` or
``times`` (2..3 operands of 1..3 digits by default), e.g. ``"Q: 347 times 29 plus 15\\nA: "``.
The reference is the value of the word-for-symbol translation under the usual precedence
(``347*29+15`` -> ``"10078"``).

A perfect episode::

    Q: 347 times 29 plus 15\\nA: calc 347*29+15\\n
    = 10078\\nA: 10078\\n

A line ``calc {expr}`` is evaluated (after the simulated latency) by a safe AST walk over
int literals, + - *, unary +/- and parentheses only, with bounded length and magnitude;
anything else observes ``"= error\\nA: "``. Any other line is the final answer (reward 1 iff
it equals the reference). See `ToolEnv` for the turn limit.
"""

from __future__ import annotations

import ast
import operator
import random
from collections.abc import Callable

from marlaas.envs.base import Env, Example, Segment, Tool
from marlaas.envs.tasks.arithmetic import random_number
from marlaas.envs.tasks.common import (
    OBS_SUFFIX,
    Candidate,
    GeneratedFamily,
    ToolEnv,
    check_range,
    meta_field,
)
from marlaas.errors import ConfigError

_WORDS = {"plus": "+", "minus": "-", "times": "*"}
_BINOPS: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
}
MAX_EXPR_CHARS = 80
MAX_ABS_VALUE = 10**15


class CalcError(ValueError):
    """The expression is not a small, safe integer expression."""


def safe_eval(expr: str) -> int:
    """The value of `expr`; raises `CalcError` for anything but bounded int arithmetic."""
    if len(expr) > MAX_EXPR_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError) as exc:
        raise CalcError("not an expression") from exc
    return _eval(tree.body)


def _eval(node: ast.expr) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        inner = _eval(node.operand)
        value = -inner if isinstance(node.op, ast.USub) else inner
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        value = _BINOPS[type(node.op)](_eval(node.left), _eval(node.right))
    else:
        raise CalcError(f"{type(node).__name__} is not allowed")
    if abs(value) > MAX_ABS_VALUE:
        raise CalcError("value out of range")
    return value


def calc_output(expr: str) -> str:
    """The tool's output line for `expr`: ``"= {value}"`` or ``"= error"``."""
    try:
        return f"= {safe_eval(expr)}"
    except CalcError:
        return "= error"


class CalculatorEnv(ToolEnv):
    tool = "calc"
    tools = (
        Tool(
            "calc",
            "Evaluates an integer expression with + - * and parentheses.",
            "expression",
            "The expression, e.g. 347*29+15",
        ),
    )

    async def call_tool(self, argument: str) -> str:
        return calc_output(argument)


class CalculatorFamily(GeneratedFamily):
    name = "calculator"
    max_turns = 3

    def __init__(
        self,
        *,
        tool_latency_s: tuple[float, float] = (0.0, 0.0),
        eval_fraction: float = 0.2,
        max_digits: int = 3,
        min_operands: int = 2,
        max_operands: int = 3,
    ) -> None:
        super().__init__(tool_latency_s=tool_latency_s, eval_fraction=eval_fraction)
        self.max_digits = check_range("max_digits", max_digits, 1, 4)
        self.min_operands = check_range("min_operands", min_operands, 2, 5)
        self.max_operands = check_range("max_operands", max_operands, 2, 5)
        if max_operands < min_operands:
            raise ConfigError(f"max_operands ({max_operands}) must be >= min_operands")

    def draw(self, rng: random.Random) -> Candidate:
        count = rng.randint(self.min_operands, self.max_operands)
        numbers = [random_number(rng, self.max_digits) for _ in range(count)]
        words = [rng.choice(list(_WORDS)) for _ in range(count - 1)]
        question = str(numbers[0])
        expression = str(numbers[0])
        for word, number in zip(words, numbers[1:], strict=True):
            question += f" {word} {number}"
            expression += f"{_WORDS[word]}{number}"
        return Candidate(
            key=expression,
            question=question,
            reference=str(safe_eval(expression)),
            meta={"expression": expression},
        )

    def make_env(self, example: Example) -> Env:
        return CalculatorEnv(
            example,
            max_turns=self.max_turns,
            latency_s=self.tool_latency_s,
            rng=self.env_rng(example),
        )

    def demonstration(self, example: Example) -> list[Segment]:
        expression = str(meta_field(example, "expression"))
        return [
            Segment(example.prompt, False),
            Segment(f"calc {expression}\n", True),
            Segment(calc_output(expression) + OBS_SUFFIX, False),
            Segment(example.reference + "\n", True),
        ]
