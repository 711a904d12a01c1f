"""OpenAI grader templates: `{{ namespace.path }}` placeholders inside grader strings.

The syntax, as OpenAI's graders guide documents it: every `{{ ... }}` holds a namespace,
`item` (the dataset row) or `sample` (the model's answer: `output_text`, `output_json`,
`output_tools`, `choices`), followed by a JSON-path-like chain of `.key` or `[index]`
steps, e.g. `{{item.reference_answer}}`, `{{ sample.output_json.steps[0] }}`. Text
outside placeholders is kept as it is.

`parse_template` checks a string when a grader spec is parsed (a bad template is a spec
error, never a surprise while training); `render_template` substitutes values: strings
as they are, numbers and booleans as JSON spells them, objects and lists as compact
JSON. A path that does not exist raises `TemplateVariableError`, which says whether the
missing part was the item's or the sample's, so the caller can tell a bad row or spec
from a model answer that lacks a field. Pure Python; no heavy import.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from marlaas.errors import GraderError

Namespace = Literal["item", "sample"]
NAMESPACES: tuple[str, ...] = ("item", "sample")

_OPEN, _CLOSE = "{{", "}}"
_STEP = re.compile(r"\s*(?:\.\s*([A-Za-z0-9_\-]+)|\[\s*(\d+)\s*\])")
_HEAD = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)")


class TemplateVariableError(GraderError):
    """A placeholder's path is missing from the values it is rendered with."""

    def __init__(self, namespace: Namespace, path: str, reason: str) -> None:
        super().__init__(f"{{{{{path}}}}}: {reason}")
        self.namespace = namespace
        self.path = path


@dataclass(frozen=True)
class Placeholder:
    """One `{{ ... }}`: its namespace and its steps (keys or list indices)."""

    namespace: Namespace
    steps: tuple[str | int, ...]

    @property
    def path(self) -> str:
        out: str = self.namespace
        for step in self.steps:
            out += f"[{step}]" if isinstance(step, int) else f".{step}"
        return out


#: A parsed template: literal text and placeholders, in order.
Parts = tuple[str | Placeholder, ...]


def _placeholder(body: str) -> Placeholder:
    head = _HEAD.match(body)
    if head is None:
        raise ValueError(
            f"'{{{{{body}}}}}' names no variable; write {{{{item.FIELD}}}} or "
            "{{sample.output_text}}"
        )
    name = head.group(1)
    if name not in NAMESPACES:
        raise ValueError(
            f"'{{{{{body}}}}}' uses the namespace {name!r}; the only namespaces are "
            "'item' (the dataset row) and 'sample' (the model's answer)"
        )
    steps: list[str | int] = []
    at = head.end()
    while at < len(body) and body[at:].strip():
        step = _STEP.match(body, at)
        if step is None:
            raise ValueError(
                f"'{{{{{body}}}}}' is not a variable path at {body[at:].strip()!r}; use "
                "'.key' or '[index]' steps, e.g. {{item.answer}} or {{item.choices[0]}}"
            )
        steps.append(step.group(1) if step.group(1) is not None else int(step.group(2)))
        at = step.end()
    if name == "item" and not steps:
        raise ValueError("'{{item}}' needs a field, e.g. {{item.reference_answer}}")
    return Placeholder(name, tuple(steps))  # type: ignore[arg-type]


def parse_template(text: str) -> Parts:
    """The literal pieces and placeholders of `text`; `ValueError` naming the problem
    (an unclosed `{{`, an unknown namespace, a malformed path)."""
    parts: list[str | Placeholder] = []
    at = 0
    while (start := text.find(_OPEN, at)) != -1:
        end = text.find(_CLOSE, start + len(_OPEN))
        if end == -1:
            raise ValueError(
                f"unclosed '{{{{' at character {start}: {text[start : start + 40]!r}; "
                "close it with '}}'"
            )
        if start > at:
            parts.append(text[at:start])
        parts.append(_placeholder(text[start + len(_OPEN) : end]))
        at = end + len(_CLOSE)
    if at < len(text):
        parts.append(text[at:])
    return tuple(parts)


def placeholders(text: str) -> list[Placeholder]:
    return [p for p in parse_template(text) if isinstance(p, Placeholder)]


def lookup(placeholder: Placeholder, values: Mapping[str, object]) -> object:
    """The value a placeholder names in `values` (`{"item": ..., "sample": ...}`)."""
    current: object = values.get(placeholder.namespace)
    walked: str = placeholder.namespace
    for step in placeholder.steps:
        if isinstance(step, int):
            if not isinstance(current, Sequence) or isinstance(current, str | bytes):
                raise TemplateVariableError(
                    placeholder.namespace, placeholder.path, f"{walked} is not a list"
                )
            if step >= len(current):
                raise TemplateVariableError(
                    placeholder.namespace,
                    placeholder.path,
                    f"{walked} has {len(current)} element(s), no index {step}",
                )
            current = current[step]
            walked += f"[{step}]"
            continue
        if not isinstance(current, Mapping) or step not in current:
            what = "has no field" if isinstance(current, Mapping) else "is not an object, no field"
            raise TemplateVariableError(
                placeholder.namespace, placeholder.path, f"{walked} {what} {step!r}"
            )
        current = current[step]
        walked += f".{step}"
    return current


def as_text(value: object) -> str:
    """A value as a template writes it: strings as they are, the rest as compact JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)


def render_template(parts: Parts, values: Mapping[str, object]) -> str:
    return "".join(p if isinstance(p, str) else as_text(lookup(p, values)) for p in parts)
