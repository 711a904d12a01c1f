"""OpenAI's grader schema (reinforcement fine-tuning and `alpha/graders`), as specs.

The shapes are the ones the `openai` SDK sends (`openai.types.graders`):

- `string_check`: `input` compared with `reference` by `operation` (`eq`, `ne`, `like`:
  contains, `ilike`: contains ignoring case); 1.0 or 0.0.
- `text_similarity`: `input` against `reference` by `evaluation_metric` (fuzzy_match,
  bleu, gleu, meteor, rouge_1..5, rouge_l; `cosine` needs an embedding model, which
  marlaas does not serve, so it is refused here).
- `python`: `source` defining `grade(sample, item) -> float`, run in the sandbox.
- `score_model` / `label_model`: a judge model marlaas serves (`base`, or a model of the
  caller) reads the `input` messages and answers a score within `range`, or one of
  `labels` (1.0 when it is one of `passing_labels`).
- `multi`: named sub-graders (`graders`, an object of name -> grader; a single grader is
  named by its own `name`) combined by the `calculate_output` formula.

Strings marked as templates are checked with `openai_templates.parse_template` when the
spec is parsed. What marlaas cannot honour is refused, naming the field: `cosine`,
`image_tag`, `reasoning_effort`, image and audio content. `parse_openai_grader` turns every
problem into one `OpenAIGraderError` whose `param` is the field's path (e.g.
`grader.graders.email.reference`). No heavy import here.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError, ValidationInfo, field_validator

from marlaas.config.openai_templates import parse_template
from marlaas.config.specs import Spec, check_grade_source
from marlaas.errors import GraderError

OPENAI_GRADER_TYPES: tuple[str, ...] = (
    "string_check",
    "text_similarity",
    "python",
    "score_model",
    "label_model",
    "multi",
)
TEXT_METRICS: tuple[str, ...] = (
    "fuzzy_match",
    "bleu",
    "gleu",
    "meteor",
    "rouge_1",
    "rouge_2",
    "rouge_3",
    "rouge_4",
    "rouge_5",
    "rouge_l",
)
#: What `calculate_output` may call, besides + - * / ^ and parentheses (OpenAI's list).
FORMULA_FUNCTIONS: tuple[str, ...] = ("min", "max", "abs", "floor", "ceil", "exp", "sqrt", "log")
MAX_SOURCE_CHARS = 256 * 1024
_VARIABLE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


class OpenAIGraderError(GraderError):
    """An OpenAI grader spec that marlaas cannot run; `param` is the field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _template(value: str) -> str:
    parse_template(value)  # raises ValueError naming the problem
    return value


class _Named(Spec):
    name: str = Field(..., min_length=1, max_length=256, description="The grader's name.")


class StringCheckGrader(_Named):
    type: Literal["string_check"]
    input: str = Field(..., max_length=100_000, description="Template of the text checked.")
    reference: str = Field(..., max_length=100_000, description="Template of the reference.")
    operation: Literal["eq", "ne", "like", "ilike"]

    _templates = field_validator("input", "reference")(_template)


class TextSimilarityGrader(_Named):
    type: Literal["text_similarity"]
    input: str = Field(..., max_length=100_000, description="Template of the text graded.")
    reference: str = Field(..., max_length=100_000, description="Template of the reference.")
    evaluation_metric: str = Field(..., description="One of TEXT_METRICS.")

    _templates = field_validator("input", "reference")(_template)

    @field_validator("evaluation_metric")
    @classmethod
    def _metric(cls, metric: str) -> str:
        if metric == "cosine":
            raise ValueError(
                "cosine similarity needs an embedding model, and this marlaas serves none; "
                f"use one of {', '.join(TEXT_METRICS)}"
            )
        if metric not in TEXT_METRICS:
            raise ValueError(f"unknown metric {metric!r}; use one of {', '.join(TEXT_METRICS)}")
        return metric


class PythonGrader(_Named):
    """`source` defines `def grade(sample: dict, item: dict) -> float`; it runs in the
    sandbox with the standard library only (no numpy, no network)."""

    type: Literal["python"]
    source: str = Field(..., min_length=1, max_length=MAX_SOURCE_CHARS)
    image_tag: str | None = Field(
        None, description="OpenAI's runtime image; marlaas has one runtime (refused if set)."
    )

    @field_validator("image_tag")
    @classmethod
    def _image(cls, tag: str | None) -> str | None:
        if tag is not None:
            raise ValueError(
                "marlaas runs python graders in its own sandbox (standard library only) and "
                "has no images to choose from; leave image_tag out"
            )
        return tag

    @field_validator("source")
    @classmethod
    def _defines_grade(cls, source: str) -> str:
        check_grade_source(source, "source", "sample: dict, item: dict", ("sample", "item"))
        return source


class TextPart(Spec):
    """A text content part (`input_text` or `output_text`)."""

    type: Literal["input_text", "output_text"]
    text: str = Field(..., max_length=100_000)

    _templates = field_validator("text")(_template)


class JudgeMessage(Spec):
    """One message the judge reads; only text content (images and audio are refused).
    A plain string content is read as one `input_text` part."""

    role: Literal["user", "assistant", "system", "developer"]
    content: tuple[TextPart, ...]
    type: Literal["message"] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, content: Any) -> Any:
        if isinstance(content, str):
            return ({"type": "input_text", "text": content},)
        parts = content if isinstance(content, list | tuple) else [content]
        for part in parts:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind in ("input_image", "input_audio"):
                raise ValueError(
                    f"{kind} content is not supported: marlaas judges are text models; "
                    "give the content as text"
                )
        return parts

    def text(self) -> str:
        """The message's text, templates unrendered."""
        return "".join(p.text for p in self.content)


class JudgeSampling(Spec):
    """`sampling_params` of a score_model grader."""

    max_completions_tokens: int | None = Field(None, ge=1, le=4096)
    reasoning_effort: str | None = Field(None, description="Refused: marlaas judges do not reason.")
    seed: int | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)

    @field_validator("reasoning_effort")
    @classmethod
    def _no_reasoning(cls, effort: str | None) -> str | None:
        if effort is not None:
            raise ValueError(
                "marlaas judges are not reasoning models, so reasoning_effort cannot be "
                "honoured; leave it out"
            )
        return effort


class _ModelGrader(_Named):
    model: str = Field(
        ..., min_length=1, max_length=200, description="The judge: 'base' or one of your models."
    )
    input: tuple[JudgeMessage, ...] = Field(..., min_length=1, max_length=64)


class ScoreModelGrader(_ModelGrader):
    type: Literal["score_model"]
    range: tuple[float, float] = Field((0.0, 1.0), description="Lowest and highest score.")
    sampling_params: JudgeSampling | None = None

    @field_validator("range")
    @classmethod
    def _range(cls, bounds: tuple[float, float]) -> tuple[float, float]:
        if not bounds[0] < bounds[1]:
            raise ValueError(f"range must be [low, high] with low < high, got {list(bounds)}")
        return bounds


class LabelModelGrader(_ModelGrader):
    type: Literal["label_model"]
    labels: tuple[str, ...] = Field(..., min_length=2, max_length=64)
    passing_labels: tuple[str, ...] = Field(..., min_length=1)

    @field_validator("labels")
    @classmethod
    def _labels(cls, labels: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(labels)) != len(labels) or any(not x.strip() for x in labels):
            raise ValueError("labels must be distinct, non-empty strings")
        return labels

    @field_validator("passing_labels")
    @classmethod
    def _passing(cls, passing: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        labels = info.data.get("labels")
        unknown = [x for x in passing if labels is not None and x not in labels]
        if unknown:
            raise ValueError(f"passing_labels {unknown} are not among labels {list(labels or ())}")
        return passing


SubGrader = Annotated[
    StringCheckGrader | TextSimilarityGrader | PythonGrader | ScoreModelGrader | LabelModelGrader,
    Field(discriminator="type"),
]


class MultiGrader(_Named):
    type: Literal["multi"]
    graders: dict[str, SubGrader] = Field(
        ...,
        description="Named sub-graders (name -> grader); one grader object is named by its "
        "own `name` (the form the SDK's types describe).",
    )
    calculate_output: str = Field(..., min_length=1, max_length=2000)

    @field_validator("graders", mode="before")
    @classmethod
    def _one_grader(cls, graders: Any) -> Any:
        if isinstance(graders, Mapping) and isinstance(graders.get("type"), str):
            return {str(graders.get("name", "")): graders}
        return graders

    @field_validator("graders")
    @classmethod
    def _names(cls, graders: dict[str, Any]) -> dict[str, Any]:
        if not graders:
            raise ValueError("graders is empty; give at least one named sub-grader")
        for key in graders:
            if not _VARIABLE.match(key) or key in FORMULA_FUNCTIONS:
                raise ValueError(
                    f"sub-grader name {key!r} cannot be a formula variable; use letters, "
                    "digits and '_' (not starting with a digit, not a function name)"
                )
        return graders

    @field_validator("calculate_output")
    @classmethod
    def _formula(cls, formula: str, info: ValidationInfo) -> str:
        graders = info.data.get("graders")
        if graders is not None:  # else the graders' own error is reported
            check_formula(formula, set(graders))
        return formula


def formula_source(formula: str) -> str:
    """`calculate_output` as Python: `^` is a power, as in OpenAI's formulas (the formula
    has no strings, so the replacement cannot change anything else)."""
    return formula.replace("^", "**")


def check_formula(formula: str, variables: set[str]) -> None:
    """`ValueError` unless `formula` is arithmetic over `variables` and FORMULA_FUNCTIONS."""
    try:
        tree = ast.parse(formula_source(formula).strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"calculate_output {formula!r} does not parse ({exc.msg})") from None
    allowed = (
        ast.Expression,
        ast.BinOp,
        ast.UnaryOp,
        ast.Call,
        ast.Name,
        ast.Load,
        ast.Constant,
        ast.Add,
        ast.Sub,
        ast.Mult,
        ast.Div,
        ast.Pow,
        ast.USub,
        ast.UAdd,
    )
    for node in ast.walk(tree):
        if not isinstance(node, allowed):
            raise ValueError(
                f"calculate_output {formula!r} uses {type(node).__name__}; only numbers, "
                f"+ - * / ^, parentheses, the sub-graders' names and {', '.join(FORMULA_FUNCTIONS)}"
                " are allowed"
            )
        if isinstance(node, ast.Constant) and not isinstance(node.value, int | float):
            raise ValueError(f"calculate_output {formula!r}: only numeric constants are allowed")
        if isinstance(node, ast.Call) and (
            not isinstance(node.func, ast.Name)
            or node.func.id not in FORMULA_FUNCTIONS
            or node.keywords
        ):
            raise ValueError(
                f"calculate_output {formula!r}: only {', '.join(FORMULA_FUNCTIONS)} may be called"
            )
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call)}  # type: ignore[attr-defined]
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} - called
    unknown = sorted(used - variables)
    if unknown:
        raise ValueError(
            f"calculate_output uses {', '.join(unknown)}, which name no sub-grader; "
            f"the sub-graders are {', '.join(sorted(variables))}"
        )


OpenAIGrader = Annotated[
    StringCheckGrader
    | TextSimilarityGrader
    | PythonGrader
    | ScoreModelGrader
    | LabelModelGrader
    | MultiGrader,
    Field(discriminator="type"),
]

_ADAPTER: TypeAdapter[OpenAIGrader] = TypeAdapter(OpenAIGrader)


def judge_models(grader: OpenAIGrader, where: str = "grader") -> Iterator[tuple[str, str]]:
    """(field path, model) of every judge the grader calls, the path under `where` (none
    for string, similarity and python graders)."""
    if isinstance(grader, MultiGrader):
        for name, sub in grader.graders.items():
            yield from judge_models(sub, f"{where}.graders.{name}")
    elif isinstance(grader, ScoreModelGrader | LabelModelGrader):
        yield f"{where}.model", grader.model


def parse_openai_grader(obj: object, where: str = "grader") -> OpenAIGrader:
    """Validate an OpenAI grader given as plain data. `OpenAIGraderError` names the first
    bad field (`param`, under `where`) and says what to fix."""
    if not isinstance(obj, Mapping):
        raise OpenAIGraderError(
            f"{where} must be an object with a 'type' field, got {type(obj).__name__}", where
        )
    try:
        return _ADAPTER.validate_python(dict(obj))
    except ValidationError as exc:
        # The first problem only: later ones are often consequences of it.
        param, message = _describe(exc.errors()[0], where)
        raise OpenAIGraderError(message, param) from exc


def _describe(err: Mapping[str, Any], where: str) -> tuple[str, str]:
    """One pydantic error as (param path, message)."""
    # The union's tags are not fields the user wrote; drop them from the path.
    tags = set(OPENAI_GRADER_TYPES)
    loc = list(err["loc"])
    parts = [where] + [
        str(p)
        for i, p in enumerate(loc)
        if not (isinstance(p, str) and p in tags and (i == 0 or loc[i - 1] != "graders"))
    ]
    param = ".".join(parts)
    kind, msg = err["type"], str(err["msg"])
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        got = err.get("input", {}).get("type") if isinstance(err.get("input"), dict) else None
        what = f"unknown grader type {got!r}" if got is not None else "missing 'type'"
        return f"{param}.type", f"{param}.type: {what}; use one of {', '.join(OPENAI_GRADER_TYPES)}"
    if kind == "extra_forbidden":
        return param, f"{param}: unknown field; remove it (check the spelling)"
    if kind == "missing":
        return param, f"{param}: required field is missing; add it"
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    return param, f"{param}: {msg}"
