"""The environment boundary.

Lifecycle of one episode (an `Env` is used once):

1. `await env.initial_observation()` returns the prompt text the model continues.
2. The model writes one turn (it stops at a newline, EOS or one of `env.stop`).
3. `await env.step(action)` takes that turn's text and returns a `StepResult`:
   either the episode ended (`done`, with the final `reward`), or an `observation`
   (tool output, say) that is appended to the context before the model's next turn.
4. Repeat 2-3 until done. The caller enforces `env.max_turns`; if the model is still
   talking after that many turns, the caller ends the episode with reward 0.

Observation tokens never carry gradient: only the model's own turns are trained.
Tool calls and verifiers are awaited and never block the event loop.

A chat env (`chat = True`) speaks through the base's chat template instead: its prompt
and observations are text the template rendered (special tokens included), and a model
turn ends at the end-of-turn token rather than at a newline (`marlaas.envs.chat`).

A `TaskFamily` builds examples (seeded, disjoint train/eval splits), an `Env` per
example, and a demonstration for supervised warm-up of the embedded base.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Split = Literal["train", "eval"]

#: Every model turn ends at a newline; environments may add more stop strings.
TURN_END = "\n"


@dataclass(frozen=True)
class Example:
    """One task instance. `reference` is what the verifier checks against."""

    id: str
    prompt: str
    reference: str
    meta: Mapping[str, object] = field(default_factory=dict)
    #: A chat row's conversation up to its last user turn (OpenAI message format), which
    #: the task renders into `prompt` with the chat template; None for text rows.
    messages: tuple[Mapping[str, Any], ...] | None = None


@dataclass(frozen=True)
class Tool:
    """A tool an environment offers, with one string argument. In the text protocol the
    model calls it with the line `"{name} {argument}"`; a chat episode hands `schema()`
    to the chat template and passes a call in the model's own format to `step` as that
    same line."""

    name: str
    description: str
    argument: str
    argument_description: str = ""

    def schema(self) -> dict[str, Any]:
        """The OpenAI function schema chat templates take in `tools`."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": {
                        self.argument: {
                            "type": "string",
                            "description": self.argument_description or self.argument,
                        }
                    },
                    "required": [self.argument],
                },
            },
        }


@dataclass(frozen=True)
class StepResult:
    """What the environment answers to one model turn."""

    done: bool
    reward: float = 0.0
    observation: str | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.done and self.observation is not None:
            raise ValueError("a finished step carries no observation")
        if not self.done and self.observation is None:
            raise ValueError("an unfinished step must carry the next observation")


@dataclass(frozen=True)
class Segment:
    """A piece of a demonstration; `trainable` is False for prompts and tool output."""

    text: str
    trainable: bool


class Env(abc.ABC):
    """One episode of one task instance. See the module docstring for the lifecycle."""

    #: Extra stop strings for the model's turns (a newline always ends a turn).
    stop: Sequence[str] = ()
    #: Model turns allowed before the caller ends the episode with reward 0.
    max_turns: int = 1
    #: Tools the model may call (see `Tool`).
    tools: Sequence[Tool] = ()
    #: The episode is a chat rendered with the base's chat template (module docstring).
    chat: bool = False

    @abc.abstractmethod
    async def initial_observation(self) -> str:
        """The prompt text the model continues."""

    @abc.abstractmethod
    async def step(self, action: str) -> StepResult:
        """Consume one model turn (its text, without the stop string)."""


class TaskFamily(abc.ABC):
    """A built-in family of verifiable tasks."""

    name: str
    #: Turns an episode may take (1 for single-turn families).
    max_turns: int = 1

    @abc.abstractmethod
    def examples(self, split: Split, n: int, seed: int = 0) -> list[Example]:
        """`n` examples of `split`; the same (split, n, seed) always gives the same list,
        and train and eval never share an instance for the same seed."""

    @abc.abstractmethod
    def make_env(self, example: Example) -> Env:
        """A fresh environment for one episode of `example`."""

    @abc.abstractmethod
    def demonstration(self, example: Example) -> list[Segment]:
        """A correct episode as text segments, for supervised warm-up. Joined, the
        segments are exactly what the model would see and write in a perfect episode."""
