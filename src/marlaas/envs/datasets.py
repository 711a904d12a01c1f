"""User datasets: rows of (prompt, reference) scored by a declarative grader.

Loading is strict. Every row must be an object with a non-empty string reference and
either a non-empty string prompt or chat `messages` (OpenAI's chat format: a list of
`{"role", "content"}` objects, roles system, developer, user, assistant or tool, with
at least one user turn); an optional `id` field (a string or an integer) must be
unique. The first bad row fails the whole load with a `DataError` naming the file and
1-based line (JSONL) or the row index (Hugging Face); nothing is ever skipped silently,
except blank lines of a JSONL file, which are not rows. Rows without an `id` get
`row-<n>`, where `n` is the JSONL line number or the Hugging Face row index. All other
fields go to `Example.meta` and reach the grader as its `row` argument.

A chat row's prompt is its conversation up to its last user turn (later turns, e.g. a
reference answer, are not shown to the model); it is kept in `Example.messages` and
rendered with the base's chat template by whoever builds the task
(`marlaas.pipeline.data.build_task`), so `DatasetTask` gets it as `prompt` text.

`split_examples` makes a deterministic, disjoint train/eval split. `DatasetTask` is a
single-turn `TaskFamily` over such a split: the prompt is the row's prompt, the model
answers in one turn, and the grader's score is the reward.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from marlaas.envs.base import Env, Example, Segment, Split, StepResult, TaskFamily
from marlaas.errors import DataError

if TYPE_CHECKING:
    from datasets import Dataset

    from marlaas.envs.graders import Grader

_ID_FIELD = "id"
#: The field of a chat row (OpenAI's fine-tuning format).
MESSAGES_FIELD = "messages"
ROLES = ("system", "developer", "user", "assistant", "tool")


def _text_field(row: Mapping[str, Any], name: str, where: str) -> str:
    if name not in row:
        present = ", ".join(sorted(map(str, row))) or "none"
        raise DataError(f"{where}: missing field {name!r} (fields present: {present})")
    value = row[name]
    if not isinstance(value, str):
        raise DataError(
            f"{where}: field {name!r} must be a string, got {type(value).__name__} "
            f"{value!r:.60}; store it as a string, e.g. {json.dumps(str(value))[:60]}"
        )
    if not value.strip():
        raise DataError(f"{where}: field {name!r} is empty")
    return value


def row_id(row: Mapping[str, Any], where: str, default: str) -> str:
    if _ID_FIELD not in row:
        return default
    value = row[_ID_FIELD]
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise DataError(
            f"{where}: field 'id' must be a string or an integer, got {type(value).__name__}"
        )
    text = str(value)
    if not text.strip():
        raise DataError(f"{where}: field 'id' is empty")
    return text


def message_text(message: Mapping[str, Any], where: str) -> str | None:
    """A message's text: a string, or OpenAI's list of `{"type": "text", "text"}` parts."""
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(str(p["text"]) for p in content)
    raise DataError(
        f"{where}: a message's content must be a string or a list of text parts "
        '({"type": "text", "text": ...}), got ' + f"{json.dumps(content)[:60]}"
    )


def chat_prompt(value: object, where: str, name: str) -> tuple[dict[str, Any], ...]:
    """The messages of a chat row up to and including its last user turn."""
    if not isinstance(value, list) or not value:
        raise DataError(
            f"{where}: field {name!r} must be a non-empty list of chat messages "
            '({"role": ..., "content": ...}), got ' + f"{type(value).__name__}"
        )
    messages: list[dict[str, Any]] = []
    for i, message in enumerate(value):
        at = f"{where}: {name}[{i}]"
        if not isinstance(message, Mapping):
            raise DataError(f"{at} must be an object with a role and a content")
        role = message.get("role")
        if role not in ROLES:
            raise DataError(f"{at}: role must be one of {', '.join(ROLES)}, got {role!r}")
        content = message_text(message, at)
        if content is None and not (role == "assistant" and message.get("tool_calls")):
            raise DataError(f"{at}: a {role} message needs a content")
        messages.append({**message, "content": content})
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise DataError(f"{where}: {name} has no user message; the prompt ends at the last one")
    return tuple(messages[: users[-1] + 1])


def _to_example(
    row: object, where: str, default_id: str, prompt_field: str, reference_field: str | None
) -> Example:
    if not isinstance(row, Mapping):
        raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    # Chat rows carry OpenAI messages, in `messages` or in the prompt field itself.
    messages: tuple[dict[str, Any], ...] | None = None
    value = row.get(prompt_field)
    if isinstance(value, list) and value and all(isinstance(m, Mapping) for m in value):
        messages, used = chat_prompt(row[prompt_field], where, prompt_field), prompt_field
    elif prompt_field not in row and MESSAGES_FIELD in row:
        messages, used = chat_prompt(row[MESSAGES_FIELD], where, MESSAGES_FIELD), MESSAGES_FIELD
    else:
        if prompt_field not in row:
            present = ", ".join(sorted(map(str, row))) or "none"
            raise DataError(
                f"{where}: missing field {prompt_field!r} (or {MESSAGES_FIELD!r} for chat "
                f"rows; fields present: {present})"
            )
        used = prompt_field
    prompt = "" if messages is not None else _text_field(row, prompt_field, where)
    reference = "" if reference_field is None else _text_field(row, reference_field, where)
    example_id = row_id(row, where, default_id)
    skip = {used, reference_field, _ID_FIELD}
    meta = {str(k): v for k, v in row.items() if k not in skip}
    return Example(id=example_id, prompt=prompt, reference=reference, meta=meta, messages=messages)


class _HasId(Protocol):
    @property
    def id(self) -> str: ...


R = TypeVar("R", bound=_HasId)


def unique_rows(
    rows: Iterable[tuple[str, str, object]], parse: Callable[[object, str, str], R]
) -> list[R]:
    """(where, default id, raw row) triples parsed by `parse(row, where, default_id)`;
    ids must be unique (`DataError` naming both places)."""
    out: list[R] = []
    seen: dict[str, str] = {}
    for where, default_id, row in rows:
        item = parse(row, where, default_id)
        if item.id in seen:
            raise DataError(
                f"{where}: duplicate id {item.id!r} (first seen at {seen[item.id]}); "
                "ids must be unique"
            )
        seen[item.id] = where
        out.append(item)
    return out


class JSONLineError(ValueError):
    """A line of a JSON Lines file that is not UTF-8 (`kind` "UTF-8") or not JSON
    ("JSON"): its number and what the decoder said; callers word it for their readers."""

    def __init__(self, lineno: int, kind: Literal["UTF-8", "JSON"], detail: str) -> None:
        super().__init__(f"line {lineno}: not valid {kind} ({detail})")
        self.lineno, self.kind, self.detail = lineno, kind, detail


def json_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, object]]:
    """(line number, parsed value) of each non-blank line of a JSON Lines file;
    `JSONLineError` at the first line that is not UTF-8 JSON (`OSError` passes through)."""
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise JSONLineError(lineno, "UTF-8", exc.reason) from exc
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise JSONLineError(lineno, "JSON", f"{exc.msg} at column {exc.colno}") from exc
            yield lineno, value


def jsonl_rows(name: str, max_rows: int | None = None) -> Iterator[tuple[str, str, object]]:
    """(where, default id, raw row) of each non-blank line of a JSON Lines file, at most
    `max_rows`; `DataError` naming the file and line of one that is not UTF-8 JSON
    (`OSError` of the file passes through)."""
    if max_rows is not None and max_rows <= 0:
        return
    count = 0
    try:
        for lineno, row in json_lines(name):
            yield f"{name}:{lineno}", f"row-{lineno}", row
            count += 1
            if max_rows is not None and count >= max_rows:
                return
    except JSONLineError as exc:
        what = "not valid UTF-8" if exc.kind == "UTF-8" else "invalid JSON"
        raise DataError(f"{name}:{exc.lineno}: {what} ({exc.detail})") from exc


def load_jsonl_rows(
    path: str | os.PathLike[str],
    parse: Callable[[object, str, str], R],
    max_rows: int | None = None,
) -> list[R]:
    """The rows of a JSON Lines file, each parsed by `parse(row, where, default_id)`,
    ids unique; `DataError` naming the file (and line) when it cannot be read, a row is
    bad, or there is none."""
    name = os.fspath(path)
    try:
        out = unique_rows(jsonl_rows(name, max_rows), parse)
    except OSError as exc:
        raise DataError(f"{name}: cannot read the dataset ({exc.strerror or exc})") from exc
    if not out:
        raise DataError(f"{name}: the file has no rows")
    return out


def _collect(
    rows: Iterable[tuple[str, str, object]], prompt_field: str, reference_field: str | None
) -> list[Example]:
    """(where, default id, raw row) triples to examples; ids must be unique."""
    return unique_rows(
        rows, lambda row, where, did: _to_example(row, where, did, prompt_field, reference_field)
    )


def _check_max_rows(max_rows: int | None) -> None:
    if max_rows is not None and max_rows < 1:
        raise DataError(f"max_rows must be at least 1 or None, got {max_rows}")


def load_jsonl(
    path: str | os.PathLike[str],
    prompt_field: str = "prompt",
    reference_field: str | None = "reference",
    max_rows: int | None = None,
) -> list[Example]:
    """Examples from a JSON Lines file (one object per line), at most `max_rows` of them.

    Raises `DataError` naming the file and line of the first bad row.
    """
    _check_max_rows(max_rows)
    return load_jsonl_rows(
        path,
        lambda row, where, did: _to_example(row, where, did, prompt_field, reference_field),
        max_rows,
    )


def from_hf_dataset(
    ds: Dataset,
    prompt_field: str = "prompt",
    reference_field: str = "reference",
    max_rows: int | None = None,
) -> list[Example]:
    """Examples from a Hugging Face `datasets.Dataset` (one split, not a DatasetDict).

    Raises `DataError` naming the row index of the first bad row.
    """
    _check_max_rows(max_rows)
    columns = getattr(ds, "column_names", None)
    if not isinstance(columns, list):
        raise DataError(
            f"expected a datasets.Dataset, got {type(ds).__name__}; "
            "for a DatasetDict pass one split, e.g. ds['train']"
        )
    need = [reference_field]
    if prompt_field not in columns and MESSAGES_FIELD not in columns:
        need.append(prompt_field)
    for name in need:
        if name not in columns:
            raise DataError(f"dataset has no column {name!r} (columns: {', '.join(columns)})")

    def rows() -> Iterable[tuple[str, str, object]]:
        for index, row in enumerate(ds):
            if max_rows is not None and index >= max_rows:
                return
            yield f"dataset row {index}", f"row-{index}", row

    examples = _collect(rows(), prompt_field, reference_field)
    if not examples:
        raise DataError("the dataset has no rows")
    return examples


def split_examples(
    examples: Sequence[R], eval_fraction: float, seed: int
) -> tuple[list[R], list[R]]:
    """A deterministic, disjoint (train, eval) split; each keeps the input order.

    The eval part has `round(len * eval_fraction)` examples, but at least one (and at
    most all but one) when `0 < eval_fraction` and there are two or more examples.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    ids = [ex.id for ex in examples]
    if len(set(ids)) != len(ids):
        raise DataError("examples have duplicate ids; a split needs unique ids")
    n = len(examples)
    n_eval = round(n * eval_fraction)
    if eval_fraction > 0 and n >= 2:
        n_eval = min(max(n_eval, 1), n - 1)
    order = list(range(n))
    random.Random(f"split:{seed}").shuffle(order)
    eval_idx = set(order[:n_eval])
    train = [ex for i, ex in enumerate(examples) if i not in eval_idx]
    evals = [ex for i, ex in enumerate(examples) if i in eval_idx]
    return train, evals


class DatasetEnv(Env):
    """One single-turn episode: the prompt, one model turn, the grader's score."""

    max_turns = 1

    def __init__(self, example: Example, grader: Grader, chat: bool = False) -> None:
        self.example = example
        self.grader = grader
        self.chat = chat

    async def initial_observation(self) -> str:
        return self.example.prompt

    async def step(self, action: str) -> StepResult:
        # A GraderError propagates: the caller fails this tenant's work, nobody else's.
        score = await self.grader(action, self.example.reference, self.example.meta)
        return StepResult(done=True, reward=score, metrics={"score": score})


class DatasetTask(TaskFamily):
    """A tenant's dataset and grader as a single-turn task family.

    The split is fixed when the task is built (`split_examples(examples, eval_fraction,
    split_seed)`), or given explicitly with `eval_examples`. `examples(split, n, seed)`
    draws `n` examples of that split in a seeded order; if `n` exceeds the split, it
    continues with a fresh permutation (another epoch), so ids repeat only across epochs.
    `chat`: the prompts were rendered with the base's chat template (its episodes are
    chat episodes); a chat row whose prompt was not rendered is a `DataError`.
    """

    max_turns = 1

    def __init__(
        self,
        examples: Sequence[Example],
        grader: Grader,
        *,
        name: str = "dataset",
        eval_fraction: float = 0.1,
        split_seed: int = 0,
        eval_examples: Sequence[Example] | None = None,
        chat: bool = False,
    ) -> None:
        self.name = name
        self.grader = grader
        self.chat = chat
        raw = next((ex for ex in [*examples, *(eval_examples or ())] if not ex.prompt), None)
        if raw is not None:
            raise DataError(
                f"task {name!r}: example {raw.id!r} is a chat row whose messages were not "
                "rendered; build the task with the base's chat template (`build_task`)"
            )
        if eval_examples is None:
            self.train, self.eval = split_examples(examples, eval_fraction, split_seed)
        else:
            self.train, self.eval = list(examples), list(eval_examples)
            shared = {ex.id for ex in self.train} & {ex.id for ex in self.eval}
            if shared:
                raise DataError(
                    f"train and eval share ids {sorted(shared)[:5]}; they must be disjoint"
                )
        if not self.train:
            raise DataError(f"task {name!r}: the train split is empty")

    def examples(self, split: Split, n: int, seed: int = 0) -> list[Example]:
        pool = self.train if split == "train" else self.eval
        if n <= 0:
            return []
        if not pool:
            raise DataError(f"task {self.name!r}: the {split} split is empty")
        drawn: list[Example] = []
        epoch = 0
        while len(drawn) < n:
            order = list(pool)
            random.Random(f"{split}:{seed}:{epoch}").shuffle(order)
            drawn.extend(order[: n - len(drawn)])
            epoch += 1
        return drawn

    def make_env(self, example: Example) -> Env:
        return DatasetEnv(example, self.grader, self.chat)

    def demonstration(self, example: Example) -> list[Segment]:
        return [Segment(example.prompt, False), Segment(example.reference + "\n", True)]
