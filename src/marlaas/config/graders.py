"""Declarative grader specs: a tenant says *how* a completion is scored, as data.

A grader spec is a union keyed on `type`:

- `exact`: the completion equals / contains / starts with the reference.
- `numeric`: the first or last number in the completion is within tolerance of the
  reference number.
- `regex`: the completion matches a pattern (optionally built from the reference).
- `math`: the completion is mathematically equivalent to the reference (math-verify).
- `python`: user code `def grade(completion, reference, row) -> float`, run only in
  the sandbox.
- `weighted`: a weighted mean of child graders (nesting allowed).
- `openai`: a grader in OpenAI's schema (`marlaas.config.openai_graders`), as the
  OpenAI-compatible fine-tuning API receives it.

Every spec is checked when it is parsed, not when it first scores: a regex compiles,
Python code parses and defines a top-level `grade`, weights are positive. `parse_grader`
turns pydantic's validation errors into one `GraderError` whose message names the field
path (e.g. `graders.1.grader.pattern`) and what to fix. Specs are frozen and forbid
unknown fields; this module imports no heavy library.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError, ValidationInfo, field_validator

from marlaas.config.openai_graders import OPENAI_GRADER_TYPES, OpenAIGrader, judge_models
from marlaas.config.specs import Float, Spec, check_grade_source
from marlaas.errors import GraderError

#: The placeholder a regex pattern may contain; it is replaced by the escaped reference.
REFERENCE_PLACEHOLDER = "{reference}"


class ExactGraderSpec(Spec):
    """1.0 if the completion matches the reference as a string, else 0.0."""

    type: Literal["exact"] = Field(description="Selects this grader.")
    strip: bool = Field(
        True, description="Strip leading/trailing whitespace of both strings before comparing."
    )
    case_sensitive: bool = Field(
        True, description="Compare case-sensitively; False compares case-folded strings."
    )
    mode: Literal["equals", "contains", "startswith"] = Field(
        "equals",
        description="equals: the whole completion is the reference; contains: the reference "
        "occurs anywhere in it; startswith: the completion begins with the reference.",
    )


class NumericGraderSpec(Spec):
    """1.0 if a number parsed from the completion is close to the reference number.

    Close means `abs(got - want) <= max(abs_tol, rel_tol * abs(want))`. The reference must
    itself be a number (e.g. "42", "-3.5", "1e-3", "1,000").
    """

    type: Literal["numeric"] = Field(description="Selects this grader.")
    pick: Literal["first", "last"] = Field(
        "last", description="Which number of the completion is the answer."
    )
    abs_tol: Float = Field(1e-6, ge=0, description="Absolute tolerance.")
    rel_tol: Float = Field(0.0, ge=0, description="Tolerance relative to the reference's size.")


class RegexGraderSpec(Spec):
    """1.0 if the completion matches `pattern`, else 0.0."""

    type: Literal["regex"] = Field(description="Selects this grader.")
    substitute_reference: bool = Field(
        False, description="Replace '{reference}' in the pattern by the escaped reference."
    )
    pattern: str = Field(
        ...,
        min_length=1,
        description="A Python regular expression. With `substitute_reference`, every "
        "'{reference}' in it is replaced by the row's reference, regex-escaped.",
    )
    mode: Literal["fullmatch", "search"] = Field(
        "fullmatch",
        description="fullmatch: the whole (stripped) completion must match; search: a "
        "match anywhere is enough.",
    )
    ignore_case: bool = Field(False, description="Match case-insensitively.")
    strip: bool = Field(True, description="Strip whitespace of the completion before matching.")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str, info: ValidationInfo) -> str:
        compiled = pattern
        if info.data.get("substitute_reference", False):
            if REFERENCE_PLACEHOLDER not in pattern:
                raise ValueError(
                    "substitute_reference is true but the pattern has no '{reference}'; "
                    "add it where the reference goes, or set substitute_reference to false"
                )
            compiled = pattern.replace(REFERENCE_PLACEHOLDER, re.escape("ref"))
        try:
            re.compile(compiled)
        except re.error as exc:
            raise ValueError(
                f"{pattern!r} is not a valid regular expression ({exc}); fix the pattern "
                "(escape literal characters such as '(' or '+' with a backslash)"
            ) from exc
        return pattern


class MathGraderSpec(Spec):
    """1.0 if the completion's final answer is mathematically equivalent to the reference.

    Uses math-verify: "1/2", "0.5" and "\\frac{1}{2}" are all equal; LaTeX, \\boxed{}
    and plain expressions are understood.
    """

    type: Literal["math"] = Field(description="Selects this grader.")
    timeout_s: Float = Field(
        5.0, gt=0, le=60, description="Give up (GraderError) after this many seconds."
    )
    max_chars: int = Field(
        4000,
        ge=16,
        description="Only the last this many characters of the completion are parsed; "
        "this bounds the cost of pathological inputs.",
    )


class PythonGraderSpec(Spec):
    """User code that scores a completion; it runs only in the sandbox.

    The code must define a top-level `def grade(completion: str, reference: str,
    row: dict) -> float` returning a number in [0, 1] (a bool counts as 0 or 1). It runs
    in a fresh interpreter with the standard library only (no site-packages), without
    network. Prints go to the grader's log, not to the score. `row` holds the example's
    other fields (values that are not JSON become strings).
    """

    type: Literal["python"] = Field(description="Selects this grader.")
    code: str = Field(
        ...,
        min_length=1,
        max_length=100_000,
        description="Python source defining `def grade(completion, reference, row)`.",
    )
    timeout_s: Float = Field(
        5.0, gt=0, le=300, description="Wall-clock (and CPU) limit of one call, in seconds."
    )

    @field_validator("code")
    @classmethod
    def _defines_grade(cls, code: str) -> str:
        check_grade_source(
            code,
            "code",
            "completion: str, reference: str, row: dict",
            ("completion", "reference", "row"),
        )
        return code


class WeightedChild(Spec):
    """One child of a weighted grader."""

    weight: Float = Field(..., gt=0, description="Relative weight (> 0); weights are normalised.")
    grader: GraderSpec = Field(..., description="The child grader (any type, nesting allowed).")


class WeightedGraderSpec(Spec):
    """The weighted mean of its children's scores, with weights normalised to sum 1."""

    type: Literal["weighted"] = Field(description="Selects this grader.")
    graders: tuple[WeightedChild, ...] = Field(
        ..., description="The children, each `{weight, grader}`; at least one."
    )

    @field_validator("graders")
    @classmethod
    def _not_empty(cls, graders: tuple[WeightedChild, ...]) -> tuple[WeightedChild, ...]:
        # A validator rather than min_length: pydantic reports min_length spuriously
        # whenever a child fails, which buries the real error.
        if not graders:
            raise ValueError("a weighted grader needs at least one child grader")
        return graders

    @property
    def normalized_weights(self) -> tuple[float, ...]:
        total = sum(child.weight for child in self.graders)
        return tuple(child.weight / total for child in self.graders)


class OpenAIGraderSpec(Spec):
    """An OpenAI grader (string_check, text_similarity, python, score_model, label_model,
    multi): the item its templates see is the row, the sample is the completion. Its
    reward must lie in [0, 1]."""

    type: Literal["openai"] = Field(description="Selects this grader.")
    grader: OpenAIGrader = Field(..., description="The grader, in OpenAI's schema.")


GraderSpec = Annotated[
    ExactGraderSpec
    | NumericGraderSpec
    | RegexGraderSpec
    | MathGraderSpec
    | PythonGraderSpec
    | WeightedGraderSpec
    | OpenAIGraderSpec,
    Field(discriminator="type"),
]

WeightedChild.model_rebuild()
WeightedGraderSpec.model_rebuild()

GRADER_TYPES: tuple[str, ...] = (
    "exact",
    "numeric",
    "regex",
    "math",
    "python",
    "weighted",
    "openai",
)

_ADAPTER: TypeAdapter[GraderSpec] = TypeAdapter(GraderSpec)


def grader_judges(spec: GraderSpec, where: str = "grader") -> Iterator[tuple[str, str]]:
    """(field path, model) of every judge model the grader calls: the `score_model` and
    `label_model` graders inside its OpenAI graders, nested weighted children included."""
    if isinstance(spec, WeightedGraderSpec):
        for i, child in enumerate(spec.graders):
            yield from grader_judges(child.grader, f"{where}.graders.{i}.grader")
    elif isinstance(spec, OpenAIGraderSpec):
        yield from judge_models(spec.grader, f"{where}.grader")


def parse_grader(obj: Mapping[str, Any]) -> GraderSpec:
    """Validate a grader spec given as plain data (parsed JSON or YAML).

    Raises `GraderError` naming each bad field's path and what to fix.
    """
    if not isinstance(obj, Mapping):
        raise GraderError(
            f"a grader spec must be an object with a 'type' field, got {type(obj).__name__}"
        )
    try:
        return _ADAPTER.validate_python(dict(obj))
    except ValidationError as exc:
        problems = "; ".join(_describe(err) for err in exc.errors())
        raise GraderError(f"invalid grader spec: {problems}") from exc


def _describe(err: Mapping[str, Any]) -> str:
    """One pydantic error as 'at `path`: what is wrong (what to do)'."""
    # Drop the union's tag names from the location: they are not fields the user wrote.
    tags = set(GRADER_TYPES) | set(OPENAI_GRADER_TYPES)
    parts = [str(p) for p in err["loc"] if not (isinstance(p, str) and p in tags)]
    path = ".".join(parts) or "<root>"
    kind = err["type"]
    msg = str(err["msg"])
    if kind == "union_tag_invalid":
        got = err.get("input", {}).get("type") if isinstance(err.get("input"), dict) else None
        return (
            f"at `{_join(path, 'type')}`: unknown grader type {got!r}; "
            f"use one of {', '.join(GRADER_TYPES)}"
        )
    if kind == "union_tag_not_found":
        return f"at `{_join(path, 'type')}`: missing; add 'type': one of {', '.join(GRADER_TYPES)}"
    if kind == "extra_forbidden":
        return f"at `{path}`: unknown field; remove it (check the spelling)"
    if kind == "missing":
        return f"at `{path}`: required field is missing; add it"
    if msg.startswith("Value error, "):
        return f"at `{path}`: {msg[len('Value error, ') :]}"
    got = err.get("input")
    if isinstance(got, str | int | float | bool | None):
        return f"at `{path}`: {msg} (got {got!r})"
    return f"at `{path}`: {msg}"


def _join(path: str, field: str) -> str:
    return field if path == "<root>" else f"{path}.{field}"
