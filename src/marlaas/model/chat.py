"""Prompts as the base's tokenizer expects them: plain text with the BOS token the
tokenizer adds itself, and conversations rendered with its chat template.

Invariants:
- A text prompt gets the tokenizer's BOS token exactly when the tokenizer adds one
  itself (`add_special_tokens=True` starts with it) and the text does not already
  start with it; never an EOS or any other special token. Observations appended later
  in an episode get no special tokens.
- A rendered chat carries the special tokens its template writes, and nothing more
  (as `apply_chat_template(..., tokenize=True)` does).
- Rendering never mutates the tokenizer.
- A chat episode's context is the model's own tokens plus what the template renders
  around them (`ToolChat`): the text after a model turn is the difference between the
  template's rendering of the conversation with and without the next turn, so the
  context equals the template's rendering of the whole conversation up to the model's
  own wording of its turns.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from marlaas.envs.base import Tool
from marlaas.errors import ConfigError, ModelError

#: An OpenAI-format chat message: `{"role": ..., "content": ...}` and, for assistant
#: turns that call tools, `tool_calls`.
Message = Mapping[str, Any]


def adds_bos(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The BOS id the tokenizer puts in front of text by itself, or None."""
    bos = tokenizer.bos_token_id
    if not isinstance(bos, int):
        return None
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bos if ids and ids[0] == bos else None


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """A plain-text prompt's ids: the text, with BOS as the tokenizer expects."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    bos = adds_bos(tokenizer)
    if bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids


def encode_rendered(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The ids of text a chat template rendered: its special tokens, nothing added."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def require_template(tokenizer: PreTrainedTokenizerBase, what: str) -> None:
    """`ConfigError` unless the tokenizer has a chat template; `what` needs it."""
    if not has_chat_template(tokenizer):
        raise ConfigError(
            f"{what} needs the base model's chat template, and its tokenizer has none; "
            "use a chat model (a tokenizer_config.json or chat_template.jinja with a "
            "`chat_template`), or give the data as plain `prompt` text"
        )


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    generation_prompt: bool = True,
) -> str:
    """The conversation as the tokenizer's chat template writes it (`tools` handed to
    the template when given), ending with the assistant's generation prompt."""
    require_template(tokenizer, "a chat prompt")
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=[dict(t) for t in tools] if tools else None,
        tokenize=False,
        add_generation_prompt=generation_prompt,
    )
    return str(text)


#: Ends each message in the plain chat format; also the default stop of a chat reply
#: there, because a model turn of the embedded base is one line (`envs.base.TURN_END`).
PLAIN_TURN_END = "\n"


def chat_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[tuple[str, str]]
) -> tuple[list[int], tuple[str, ...]]:
    """Token ids of a chat prompt of (role, text) messages and the default stop strings
    of its reply (the OpenAI routes' chat prompts, and a judge's).

    With a tokenizer chat template: the template with the generation prompt, no
    default stops. Without one (the embedded base), the plain format that matches the
    built-in tasks' `Q: ...\\nA: ` prompts: each message on its own line -- system and
    developer text as is, a user turn as `Q: <text>`, an assistant turn as
    `A: <text>` -- then `A: ` for the reply, which stops at the end of its line.
    """
    if has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in messages],
            tokenize=False,
            add_generation_prompt=True,
        )
        return encode_rendered(tokenizer, str(text)), ()
    prefix = {"system": "", "developer": "", "user": "Q: ", "assistant": "A: "}
    lines = [f"{prefix[role]}{content}{PLAIN_TURN_END}" for role, content in messages]
    return encode_text(tokenizer, "".join(lines) + "A: "), (PLAIN_TURN_END,)


# -- tool calls in the model's own format ------------------------------------------------

ToolStyle = Literal["tags", "json", "text"]

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: the tool's name and its arguments."""

    name: str
    arguments: Mapping[str, Any]

    def argument(self, name: str) -> str:
        """The named argument as text (a single argument of another name will do)."""
        value = self.arguments.get(name)
        if value is None and len(self.arguments) == 1:
            value = next(iter(self.arguments.values()))
        return "" if value is None else str(value)


def tool_style(tokenizer: PreTrainedTokenizerBase) -> ToolStyle:
    """How the chat template writes tool calls: `tags` (Qwen/Hermes `<tool_call>{json}
    </tool_call>`), `json` (it takes `tools` and the model answers with a JSON function
    call, OpenAI/Llama style), or `text` (no tool support: the built-in `name argument`
    line, tool output as the next user turn)."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    if "<tool_call>" in template:
        return "tags"
    if "tools" in template:
        return "json"
    return "text"


def _json_objects(text: str) -> Iterator[Any]:
    """The JSON values that start at each `{` or `[` of `text`, in order."""
    decoder = json.JSONDecoder()
    for match in re.finditer(r"[\[{]", text):
        try:
            value, _ = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue
        yield value


def _as_call(value: Any) -> ToolCall | None:
    """A `{"name", "arguments" | "parameters"}` object (or OpenAI's `{"function": ...}`,
    or a list of them: the first) as a call."""
    if isinstance(value, list):
        value = value[0] if value else None
    if isinstance(value, Mapping) and isinstance(value.get("function"), Mapping):
        value = value["function"]
    if not isinstance(value, Mapping) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI sends arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = {"input": arguments}
    if not isinstance(arguments, Mapping):
        arguments = {"input": arguments}
    return ToolCall(value["name"], dict(arguments))


class ToolChat:
    """A tool-using conversation rendered through one tokenizer's chat template.

    `prompt` opens it (the question as the user's turn, the tools handed to the
    template), `parse` reads a model turn's tool call in the template's style, and
    `tool_turn` / `user_turn` give the text that follows a model turn: the rest of the
    model's turn after its end-of-turn token, the tool result (or user message) and the
    next generation prompt, exactly as the template renders that conversation.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        require_template(tokenizer, "a chat task")
        self.tokenizer = tokenizer
        self.style: ToolStyle = tool_style(tokenizer)
        end = tokenizer.eos_token
        self._end_of_turn = end if isinstance(end, str) and end else None

    def prompt(self, question: str, tools: Sequence[Tool]) -> str:
        if self.style == "text" and tools:
            question = f"{question}\n\n{_text_tools(tools)}"
        schemas = [t.schema() for t in tools] if self.style != "text" else None
        return render_chat(self.tokenizer, [{"role": "user", "content": question}], tools=schemas)

    def parse(self, text: str, tools: Sequence[Tool]) -> ToolCall | None:
        """The model's call of one of `tools`, or None (then the turn is an answer)."""
        names = {t.name: t for t in tools}
        call: ToolCall | None = None
        if self.style == "text":
            head, _, rest = text.strip().partition(" ")
            if head in names:
                call = ToolCall(head, {names[head].argument: rest.strip()})
        else:
            tagged = _TAGGED.findall(text) if self.style == "tags" else [text]
            for chunk in tagged:
                call = next(filter(None, map(_as_call, _json_objects(chunk))), None)
                if call is not None:
                    break
        return call if call is not None and call.name in names else None

    def tool_turn(self, call: ToolCall, output: str) -> str:
        """What follows a model turn that made `call`, whose tool answered `output`."""
        if self.style == "text":
            line = {"role": "assistant", "content": f"{call.name} {call.argument('')}"}
            return self._after(line, {"role": "user", "content": output})
        said: dict[str, Any] = {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": call.name, "arguments": dict(call.arguments)},
                }
            ],
        }
        result = {"role": "tool", "content": output, "name": call.name, "tool_call_id": "call_0"}
        return self._after(said, result)

    def user_turn(self, text: str) -> str:
        """What follows a model turn that the environment answers as a user would."""
        said = {"role": "assistant", "content": "OK"}
        return self._after(said, {"role": "user", "content": text})

    def _after(self, said: Message, reply: Message) -> str:
        opening: list[Message] = [{"role": "user", "content": "Hi"}]
        before = render_chat(self.tokenizer, [*opening, said], generation_prompt=False)
        after = render_chat(self.tokenizer, [*opening, said, reply])
        if not after.startswith(before):
            raise ModelError(
                "the chat template renders a conversation's earlier turns differently once "
                "another turn follows, so an episode cannot continue its own tokens; use "
                "task format text for this model"
            )
        # The model wrote its turn up to its end-of-turn token; the template may add
        # more (a newline) before the next turn.
        tail = ""
        end = self._end_of_turn
        if end is not None and end in before:
            tail = before[before.rindex(end) + len(end) :]
        return tail + after[len(before) :]


def _text_tools(tools: Sequence[Tool]) -> str:
    lines = [f"- {t.name} <{t.argument}>: {t.description}" for t in tools]
    return (
        "You may use a tool: answer with one line `<tool> <argument>` and its output comes "
        "back as the next message. Tools:\n" + "\n".join(lines)
    )
