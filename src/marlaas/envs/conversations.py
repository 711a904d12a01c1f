"""Supervised training data: conversations whose assistant turns are the targets.

A row of a supervised dataset (JSON Lines, one object per line) is one of:

- a chat row, OpenAI's chat fine-tuning format: `messages`, a list of `{"role",
  "content"}` objects (roles system, developer, user, assistant, tool; content a string
  or a list of text parts), with at least one assistant message to train on and a
  non-assistant message before the first assistant one. An assistant message may carry
  `weight`, 0 or 1 (default 1): only assistant messages of weight 1 are trained on,
  every other token is context. An assistant message may call tools (`tool_calls`,
  then `tool` messages answer) and the row may offer them (`tools`, OpenAI function
  schemas); whether the base can render them is the renderer's check
  (`marlaas.train.sft`). Messages after the last trained assistant turn are not part
  of the example. The legacy `function_call` / `functions` fields are refused.
- a text row: a `prompt` (or the dataset's `prompt_field`) and a `completion` string
  (OpenAI's legacy format); the completion is the target, the prompt context.

`in_format` applies the dataset's `format`: `auto` keeps both kinds, `chat` makes a text
row a user turn and the assistant's reply, `text` refuses chat rows.

An optional `id` (a string or an integer) must be unique; other fields are ignored.
Loading is strict: the first bad row fails the whole load with a `DataError` naming the
file, the 1-based line and the field; blank lines are not rows.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from marlaas.envs.datasets import MESSAGES_FIELD, ROLES, load_jsonl_rows, message_text, row_id
from marlaas.errors import DataError

#: Fields of a text row.
PROMPT_FIELD = "prompt"
COMPLETION_FIELD = "completion"
TOOLS_FIELD = "tools"
#: The weight of an assistant message (OpenAI: 0 or 1).
WEIGHT = "weight"
_LEGACY = ("function_call", "functions")


@dataclass(frozen=True)
class Conversation:
    """One supervised example: chat `messages` (each assistant message with its `weight`
    set, 0.0 or 1.0) and the `tools` they may call, or a text `prompt` and `completion`."""

    id: str
    messages: tuple[Mapping[str, Any], ...] | None = None
    tools: tuple[Mapping[str, Any], ...] = ()
    prompt: str = ""
    completion: str = ""
    #: Where the row was read (`file:line`), for messages about it.
    where: str = ""


def _weight(message: Mapping[str, Any], at: str) -> float:
    if WEIGHT not in message:
        return 1.0
    if message["role"] != "assistant":
        raise DataError(f"{at}.weight: only assistant messages carry a weight; remove it")
    value = message[WEIGHT]
    if isinstance(value, bool) or value not in (0, 1):
        raise DataError(f"{at}.weight must be 0 or 1 (1: train on this turn), got {value!r:.40}")
    return float(value)


def _messages(value: object, where: str) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or not value:
        raise DataError(
            f"{where}: field {MESSAGES_FIELD!r} must be a non-empty list of chat messages "
            '({"role": ..., "content": ...}), got ' + type(value).__name__
        )
    out: list[dict[str, Any]] = []
    for i, message in enumerate(value):
        at = f"{where}: {MESSAGES_FIELD}[{i}]"
        if not isinstance(message, Mapping):
            raise DataError(f"{at} must be an object with a role and a content")
        role = message.get("role")
        if role not in ROLES:
            raise DataError(f"{at}.role must be one of {', '.join(ROLES)}, got {role!r:.40}")
        legacy = next((k for k in _LEGACY if k in message), None)
        if legacy is not None:
            raise DataError(f"{at}.{legacy} is the legacy function format; use tool_calls")
        content = message_text(message, at)
        calls = message.get("tool_calls")
        if calls is not None and (role != "assistant" or not isinstance(calls, list)):
            raise DataError(f"{at}.tool_calls must be a list, on an assistant message")
        if content is None and not (role == "assistant" and calls):
            raise DataError(f"{at}: a {role} message needs a content")
        entry: dict[str, Any] = {**message, "content": content}
        if role == "assistant":
            entry[WEIGHT] = _weight(message, at)
        else:
            _weight(message, at)  # refuses a weight on another role
        out.append(entry)
    trained = [i for i, m in enumerate(out) if m["role"] == "assistant" and m[WEIGHT] > 0]
    if not trained:
        raise DataError(
            f"{where}: {MESSAGES_FIELD} has no assistant message to train on (each needs "
            "weight 1, the default); add the assistant's reply"
        )
    first = next(i for i, m in enumerate(out) if m["role"] == "assistant")
    if first == 0:
        raise DataError(
            f"{where}: {MESSAGES_FIELD}[0] is an assistant message; put the user's (or "
            "system's) message it answers before it"
        )
    return tuple(out[: trained[-1] + 1])


def _tools(value: object, where: str) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or not all(isinstance(t, Mapping) for t in value):
        raise DataError(f"{where}: field {TOOLS_FIELD!r} must be a list of tool objects")
    for i, tool in enumerate(value):
        if tool.get("type") != "function" or not isinstance(tool.get("function"), Mapping):
            raise DataError(
                f"{where}: {TOOLS_FIELD}[{i}] must be "
                '{"type": "function", "function": {"name": ..., "parameters": ...}}'
            )
    return tuple(dict(t) for t in value)


def in_format(conv: Conversation, mode: Literal["auto", "text", "chat"]) -> Conversation:
    """`conv` as the dataset's `format` wants it (see the module docstring)."""
    if mode == "text" and conv.messages is not None:
        raise DataError(
            f"{conv.where}: the row carries chat {MESSAGES_FIELD!r} but task.format is text; "
            "use format auto (or chat)"
        )
    if mode == "chat" and conv.messages is None:
        turns = (
            {"role": "user", "content": conv.prompt},
            {"role": "assistant", "content": conv.completion, WEIGHT: 1.0},
        )
        return Conversation(conv.id, messages=turns, where=conv.where)
    return conv


def _text(row: Mapping[str, Any], name: str, where: str) -> str:
    value = row.get(name)
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: field {name!r} must be a non-empty string")
    return value


def parse_conversation(
    row: object, where: str, default_id: str, prompt_field: str = PROMPT_FIELD
) -> Conversation:
    """One row (see the module docstring); `DataError` naming `where` and the field."""
    if not isinstance(row, Mapping):
        raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    legacy = next((k for k in _LEGACY if k in row), None)
    if legacy is not None:
        raise DataError(f"{where}: field {legacy!r} is the legacy function format; use tools")
    ident = row_id(row, where, default_id)
    if MESSAGES_FIELD in row:
        tools = _tools(row[TOOLS_FIELD], where) if row.get(TOOLS_FIELD) is not None else ()
        messages = _messages(row[MESSAGES_FIELD], where)
        return Conversation(ident, messages=messages, tools=tools, where=where)
    if prompt_field in row or COMPLETION_FIELD in row:
        prompt, completion = _text(row, prompt_field, where), _text(row, COMPLETION_FIELD, where)
        return Conversation(ident, prompt=prompt, completion=completion, where=where)
    present = ", ".join(sorted(map(str, row))) or "none"
    raise DataError(
        f"{where}: a supervised row needs {MESSAGES_FIELD!r} (chat) or {prompt_field!r} and "
        f"{COMPLETION_FIELD!r} (text); fields present: {present}"
    )


def load_conversations(
    path: str | os.PathLike[str], prompt_field: str = PROMPT_FIELD
) -> list[Conversation]:
    """The supervised examples of a JSONL file; `DataError` at the first bad row."""
    return load_jsonl_rows(
        path, lambda row, where, did: parse_conversation(row, where, did, prompt_field)
    )
