"""Shared machinery of the built-in task families.

The contract every family keeps:

- A prompt is ``"Q: {question}\\nA: "``. Every model turn is one line; the caller strips
  the newline, and the env strips surrounding whitespace again. The final answer line is
  compared with ``Example.reference`` exactly (after that strip) unless a family says
  otherwise.
- Splits. Each candidate instance has a canonical ``split_key``; a stable hash of
  (family, seed, split_key) puts it in train or eval. ``examples`` rejection-samples
  candidates from a ``random.Random`` seeded by (family, seed, split), never the global
  RNG. So one (split, n, seed) always gives the same list (a smaller n gives a prefix of
  it), and for one seed train and eval never share an instance. Inside one list the
  instances are distinct until the split's instance space runs out.
- Tool environments sleep a seeded ``random.uniform(lo, hi)`` seconds before each tool
  call with ``await asyncio.sleep``, so a slow tool never blocks the event loop.
- Bad model output never raises; it earns reward 0. Rewards are 1.0 or 0.0.
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import itertools
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from marlaas.envs.base import Env, Example, Segment, Split, StepResult, TaskFamily
from marlaas.errors import ConfigError, DataError

#: What follows a tool's output: the model's next line is its answer (or another call).
OBS_SUFFIX = "\nA: "
#: Consecutive draws outside the wanted split before we give up (a broken knob setting).
_MAX_SPLIT_MISSES = 10_000
#: Consecutive duplicate draws before duplicates are allowed (instance space exhausted).
_MAX_DUPLICATES = 200


def make_prompt(question: str) -> str:
    return f"Q: {question}\nA: "


def normalize_answer(text: str) -> str:
    """The comparable form of a model line: surrounding whitespace removed."""
    return text.strip()


def split_of(family: str, seed: int, split_key: str, eval_fraction: float) -> Split:
    """The split an instance belongs to, stable across processes and Python versions."""
    digest = hashlib.sha256(f"{family}|{seed}|{split_key}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    return "eval" if u < eval_fraction else "train"


def check_latency(tool_latency_s: tuple[float, float]) -> tuple[float, float]:
    lo, hi = (float(x) for x in tool_latency_s)
    if lo < 0 or hi < lo:
        raise ConfigError(
            f"tool_latency_s must be (low, high) with 0 <= low <= high, got {tool_latency_s!r}"
        )
    return lo, hi


def check_range(name: str, value: int, lo: int, hi: int) -> int:
    if not lo <= value <= hi:
        raise ConfigError(f"{name} must be between {lo} and {hi}, got {value!r}")
    return value


@dataclass(frozen=True)
class Candidate:
    """One drawn instance. `key` identifies it; `split_key` (default: `key`) decides its split."""

    key: str
    question: str
    reference: str
    meta: Mapping[str, object] = field(default_factory=dict)
    split_key: str | None = None


class GeneratedFamily(TaskFamily):
    """A family whose instances are drawn at random; subclasses implement `draw`."""

    def __init__(self, *, tool_latency_s: tuple[float, float], eval_fraction: float) -> None:
        if not 0.0 < eval_fraction < 1.0:
            raise ConfigError(
                f"eval_fraction must be strictly between 0 and 1, got {eval_fraction!r}"
            )
        self.tool_latency_s = check_latency(tool_latency_s)
        self.eval_fraction = eval_fraction
        self._env_counter = itertools.count()

    @abc.abstractmethod
    def draw(self, rng: random.Random) -> Candidate:
        """One random candidate instance, drawn from `rng` only."""

    def examples(self, split: Split, n: int, seed: int = 0) -> list[Example]:
        if split not in ("train", "eval"):
            raise ConfigError(f"split must be 'train' or 'eval', got {split!r}")
        if n < 0:
            raise ConfigError(f"n must be >= 0, got {n}")
        rng = random.Random(f"{self.name}/{seed}/{split}")
        out: list[Example] = []
        seen: set[str] = set()
        misses = duplicates = 0
        exhausted = False  # once the split's instances run out, repeats are allowed
        while len(out) < n:
            cand = self.draw(rng)
            split_key = cand.key if cand.split_key is None else cand.split_key
            if split_of(self.name, seed, split_key, self.eval_fraction) != split:
                misses += 1
                if misses > _MAX_SPLIT_MISSES:
                    raise DataError(
                        f"{self.name}: could not draw {split} instances; check the knobs"
                    )
                continue
            misses = 0
            if cand.key in seen and not exhausted:
                duplicates += 1
                exhausted = duplicates > _MAX_DUPLICATES
                if not exhausted:
                    continue
            duplicates = 0
            seen.add(cand.key)
            out.append(
                Example(
                    id=f"{self.name}-{split}-{seed}-{len(out)}",
                    prompt=make_prompt(cand.question),
                    reference=cand.reference,
                    meta=dict(cand.meta),
                )
            )
        return out

    def demonstration(self, example: Example) -> list[Segment]:
        """Single-turn default: the prompt, then the reference as the one model line."""
        return [Segment(example.prompt, False), Segment(example.reference + "\n", True)]

    def env_rng(self, example: Example) -> random.Random:
        """A fresh seeded RNG for one env (tool latency), deterministic in creation order."""
        return random.Random(f"{self.name}/{example.id}/{next(self._env_counter)}")


def meta_field(example: Example, key: str) -> object:
    try:
        return example.meta[key]
    except KeyError:
        raise DataError(f"example {example.id!r} lacks meta[{key!r}]") from None


class SingleTurnEnv(Env):
    """One answer line, scored by `score`; a step after the end gets reward 0."""

    max_turns = 1

    def __init__(self, example: Example) -> None:
        self.example = example
        self._done = False

    async def initial_observation(self) -> str:
        return self.example.prompt

    async def step(self, action: str) -> StepResult:
        if self._done:
            return StepResult(done=True, reward=0.0)
        self._done = True
        reward, metrics = await self.score(normalize_answer(action))
        return StepResult(done=True, reward=reward, metrics=metrics)

    async def score(self, answer: str) -> tuple[float, dict[str, float]]:
        return (1.0 if answer == self.example.reference else 0.0), {}


class ToolEnv(Env):
    """A line ``"{tool} {argument}"`` calls the tool; any other line is the final answer.

    The tool's output comes back as ``"{output}\\nA: "``. A tool call on the last allowed
    turn ends the episode with reward 0 without running the tool, as does any step after
    the end. The finishing step reports ``tool_calls`` (tools actually run) and ``turns``.
    """

    #: The first word of a tool-call line (`tools` describes it for chat episodes).
    tool: ClassVar[str]

    def __init__(
        self,
        example: Example,
        *,
        max_turns: int,
        latency_s: tuple[float, float],
        rng: random.Random,
    ) -> None:
        self.example = example
        self.max_turns = max_turns
        self._latency_s = latency_s
        self._rng = rng
        self._turns = 0
        self._tool_calls = 0
        self._done = False

    @abc.abstractmethod
    async def call_tool(self, argument: str) -> str:
        """The tool's output for `argument` (without the suffix); never raises on bad input."""

    async def initial_observation(self) -> str:
        return self.example.prompt

    async def step(self, action: str) -> StepResult:
        if self._done:
            return self._finish(0.0)
        self._turns += 1
        text = normalize_answer(action)
        head, _, argument = text.partition(" ")
        if head == self.tool:
            if self._turns >= self.max_turns:
                return self._finish(0.0)
            await asyncio.sleep(self._rng.uniform(*self._latency_s))
            self._tool_calls += 1
            output = await self.call_tool(argument.strip())
            return StepResult(done=False, observation=output + OBS_SUFFIX)
        return self._finish(1.0 if text == self.example.reference else 0.0)

    def _finish(self, reward: float) -> StepResult:
        self._done = True
        metrics = {"tool_calls": float(self._tool_calls), "turns": float(self._turns)}
        return StepResult(done=True, reward=reward, metrics=metrics)
