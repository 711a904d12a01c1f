"""Line-numbered checks of fine-tuning files in OpenAI's chat format.

A fine-tune file is JSONL: every non-blank line an object with `messages`, a non-empty
list of chat messages (`role` one of system, developer, user, assistant, tool;
`content` a string or a list of text parts); any other field is kept (graders see it
as `item`). `check_chat_file` reads the whole file and returns the number of rows, or
the first problem as `line N: what is wrong`. `check_prompts` adds what reinforcement
fine-tuning needs: each conversation ends with the user turn the model answers (the
prompt is the whole conversation, nothing of it is dropped); `check_conversations` what
supervised fine-tuning needs (`marlaas.envs.conversations`: an assistant turn to train
on, weights 0 or 1 on assistant messages only, no legacy function fields). All are
blocking: callers run them in a worker thread.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marlaas.envs.conversations import parse_conversation
from marlaas.envs.datasets import JSONLineError, json_lines
from marlaas.errors import DataError

ROLES = ("system", "developer", "user", "assistant", "tool")
_TEXT_PARTS = ("text", "input_text", "output_text")


@dataclass(frozen=True)
class FileCheck:
    rows: int
    problem: str | None


def _rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed row) of each non-blank line; `ValueError('line N: ...')`."""
    try:
        yield from json_lines(path)
    except JSONLineError as exc:
        if exc.kind == "UTF-8":
            raise ValueError(f"line {exc.lineno}: not valid UTF-8 ({exc.detail})") from None
        raise ValueError(
            f"line {exc.lineno}: not valid JSON ({exc.detail}); each line must be one JSON object"
        ) from None


def _content_problem(content: object) -> str | None:
    if isinstance(content, str):
        return None
    if isinstance(content, list) and content:
        for part in content:
            if not (
                isinstance(part, Mapping)
                and part.get("type") in _TEXT_PARTS
                and isinstance(part.get("text"), str)
            ):
                return 'content parts must be text parts such as {"type": "text", "text": "..."}'
        return None
    return "content must be a string or a non-empty list of text parts"


def _row_problem(row: object) -> str | None:
    if not isinstance(row, Mapping):
        return f"a row must be a JSON object, got a JSON {type(row).__name__}"
    messages = row.get("messages")
    if messages is None:
        present = ", ".join(sorted(map(str, row))) or "none"
        return f"missing field 'messages' (fields present: {present}); add the chat messages"
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list of chat messages"
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            return f"messages[{i}] must be an object with 'role' and 'content'"
        if message.get("role") not in ROLES:
            return (
                f"messages[{i}].role must be one of {', '.join(ROLES)}, got {message.get('role')!r}"
            )
        problem = _content_problem(message.get("content"))
        if problem is not None:
            return f"messages[{i}]: {problem}"
    return None


def check_chat_file(path: Path) -> FileCheck:
    """The number of rows of a valid chat-format file, or its first problem."""
    rows = 0
    try:
        for lineno, row in _rows(path):
            problem = _row_problem(row)
            if problem is not None:
                return FileCheck(rows, f"line {lineno}: {problem}")
            rows += 1
    except ValueError as exc:
        return FileCheck(rows, str(exc))
    if rows == 0:
        return FileCheck(0, "the file has no rows; send one JSON object per line")
    return FileCheck(rows, None)


def check_prompts(path: Path) -> str | None:
    """The first row (of a file that passed `check_chat_file`) whose conversation does
    not end with a user turn, as `line N: ...`; None when all do."""
    for lineno, row in _rows(path):
        last = row["messages"][-1]["role"]
        if last != "user":
            return (
                f"line {lineno}: the last message is a {last} message; for reinforcement "
                "fine-tuning the messages are the prompt and must end with the user turn "
                "the model answers"
            )
    return None


def check_conversations(path: Path) -> str | None:
    """The first row (of a file that passed `check_chat_file`) that supervised
    fine-tuning cannot train on, as `line N: ...`; None when every row is usable."""
    for lineno, row in _rows(path):
        try:
            parse_conversation(row, f"line {lineno}", f"row-{lineno}")
        except DataError as e:
            return str(e)
    return None
