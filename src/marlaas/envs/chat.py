"""Tasks in chat format: turns rendered with the base's chat template, for chat models.

- `render_examples`: a dataset's prompts through the template (`DatasetSpec.format`):
  chat rows (`messages`) always, text rows as one user message under `format: chat`.
- `ChatFamily` / `ChatEnv`: a task family that speaks the built-in text protocol
  (`Q: ...` prompts, `calc 1+2` tool lines, `= 3\\nA: ` observations) played as a chat
  (`TaskSpec.format: chat`): the question is the user's turn and the env's tools go to
  the template; the model's turn is read for a tool call in the template's own format
  (`marlaas.model.chat.ToolChat`) and passed to the env as its text-protocol line; the
  tool's output comes back as the template's tool-result turn and generation prompt.
  The env's rewards are unchanged; a final answer is the model's whole turn, stripped.

The embedded base keeps the text protocol (it has no chat template).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Literal

from transformers import PreTrainedTokenizerBase

from marlaas.envs.base import Env, Example, Segment, Split, StepResult, TaskFamily
from marlaas.envs.tasks.common import OBS_SUFFIX
from marlaas.errors import ConfigError, DataError
from marlaas.model.chat import ToolChat, render_chat, require_template


def render_examples(
    examples: Sequence[Example],
    tokenizer: PreTrainedTokenizerBase | None,
    mode: Literal["auto", "text", "chat"],
    where: str,
) -> tuple[list[Example], bool]:
    """`(examples, chat)`: the examples with chat-rendered prompts when the task is a
    chat task (`mode`, or `auto` with chat rows), else as they are."""
    has_chat = any(ex.messages is not None for ex in examples)
    if mode == "text" and has_chat:
        raise DataError(
            f"{where}: rows carry chat `messages` but task.format is text; use format auto "
            "(or chat) to render them with the base's chat template"
        )
    if mode == "text" or (mode == "auto" and not has_chat):
        return list(examples), False
    what = f"{where}: a chat dataset"
    if tokenizer is None:
        raise ConfigError(f"{what} needs the base model's tokenizer and its chat template")
    require_template(tokenizer, what)
    rendered = [
        replace(
            ex,
            prompt=render_chat(tokenizer, ex.messages or ({"role": "user", "content": ex.prompt},)),
        )
        for ex in examples
    ]
    return rendered, True


def _plain(text: str) -> str:
    """Text-protocol output without its turn cue: `"= 6\\nA: "` -> `"= 6"`."""
    return text.removesuffix(OBS_SUFFIX).strip()


class ChatEnv(Env):
    """`env` played as a chat through `chat` (see the module docstring)."""

    chat = True

    def __init__(self, env: Env, chat: ToolChat) -> None:
        self.env = env
        self.talk = chat
        self.stop = env.stop
        self.max_turns = env.max_turns
        self.tools = env.tools

    async def initial_observation(self) -> str:
        return self.talk.prompt(_plain(await self.env.initial_observation()), self.tools)

    async def step(self, action: str) -> StepResult:
        call = self.talk.parse(action, self.tools)
        if call is None:
            result = await self.env.step(action.strip())
        else:
            tool = next(t for t in self.tools if t.name == call.name)
            result = await self.env.step(f"{call.name} {call.argument(tool.argument)}")
        if result.done or result.observation is None:
            return result
        output = _plain(result.observation)
        turn = self.talk.tool_turn(call, output) if call else self.talk.user_turn(output)
        return replace(result, observation=turn)


class ChatFamily(TaskFamily):
    """`family`, its episodes played as chats through the base's template."""

    def __init__(self, family: TaskFamily, tokenizer: PreTrainedTokenizerBase) -> None:
        self.family = family
        self.name = family.name
        self.max_turns = family.max_turns
        self.talk = ToolChat(tokenizer)

    def examples(self, split: Split, n: int, seed: int = 0) -> list[Example]:
        return self.family.examples(split, n, seed)

    def make_env(self, example: Example) -> Env:
        return ChatEnv(self.family.make_env(example), self.talk)

    def demonstration(self, example: Example) -> list[Segment]:
        return self.family.demonstration(example)
