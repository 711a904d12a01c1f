"""An OpenAI fine-tuning request as a marlaas job: the request's wire shape, the checks
marlaas needs, and the `JobSpec` it becomes.

Hyperparameters (`method.reinforcement.hyperparameters`) map onto the job spec; `auto`
(or leaving one out) picks the default in the middle column:

| OpenAI | auto | marlaas |
| --- | --- | --- |
| `n_epochs` | 1 | `steps = ceil(n_epochs * training rows / batch_size)` |
| `batch_size` | min(4, training rows) | `algorithm.prompts_per_step` |
| `learning_rate_multiplier` | 1.0 | `algorithm.learning_rate` = multiplier x 3e-4 (GRPO's default) |
| `compute_multiplier` | 1.0 | `algorithm.group_size` = round(8 x multiplier), 2..64 samples per prompt |
| `eval_interval` | only before and after training | `eval_every`; a checkpoint is written at each eval too |
| `eval_samples` | 64 | `eval_episodes`: held-out prompts per eval (greedy, each once) |

Supervised (`method: {type: supervised, supervised: {hyperparameters}}`, also what a
request without `method` asks) trains with the cross-entropy loss on the assistant
turns (`algorithm.type sft`; OpenAI's per-message `weight` honoured):

| OpenAI | auto | marlaas |
| --- | --- | --- |
| `n_epochs` | 3 | `steps = ceil(n_epochs * training rows / batch_size)` |
| `batch_size` | min(8, training rows) | `algorithm.batch_size` (examples per step) |
| `learning_rate_multiplier` | 1.0 | `algorithm.learning_rate` = multiplier x 2e-4 (SFT's default) |

A supervised job evaluates the whole held-out set (validation loss and token accuracy)
before training, after each epoch and at the end, and checkpoints after each epoch.

The held-out prompts are the validation file's rows, or 10% of the training file's
without one. A `score_model` or `label_model` judge is any model the tenant may call
(`base`, its own jobs and checkpoints); the job's creation checks it
(`graders.check_judges`). `reasoning_effort`, `integrations`, the deprecated top-level
`hyperparameters`, unknown fields, and the `dpo` method are refused with a 400 naming
the field: marlaas never ignores a setting it cannot honour.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, TypeAdapter, ValidationError

from marlaas.config.job import JobSpec
from marlaas.config.openai_graders import (
    OpenAIGrader,
    OpenAIGraderError,
    parse_openai_grader,
)
from marlaas.config.specs import GRPOSpec, SFTSpec, describe_problems
from marlaas.envs.openai_graders import check_runnable
from marlaas.errors import GraderError
from marlaas.service.openai_ft.errors import bad_request

BASE_MODEL = "base"
DEFAULT_BATCH = 4
DEFAULT_GROUP = 8
DEFAULT_EVAL_SAMPLES = 64
DEFAULT_SFT_BATCH = 8
DEFAULT_SFT_EPOCHS = 3
#: Held-out rows a supervised eval scores at most (all of them, up to the job's limit).
MAX_SFT_EVAL_ROWS = 10_000
EVAL_FRACTION = 0.1
_GRADER = TypeAdapter(OpenAIGrader)


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _auto_or(kind: type[int] | type[float], low: float, high: float) -> Any:
    """A hyperparameter: 'auto', None, or a number of `kind` in [low, high] (a float's
    low end excluded), with one message naming the allowed values."""
    what = f"'auto' or {'an integer' if kind is int else 'a number'} from {low:g} to {high:g}"

    def check(value: Any) -> Any:
        if value is None or value == "auto":
            return value
        number = value if isinstance(value, int | float) and not isinstance(value, bool) else None
        if number is None or (kind is int and not float(number).is_integer()):
            raise ValueError(f"must be {what}, got {value!r}")
        inside = (low < number if kind is float else low <= number) and number <= high
        if not inside:
            raise ValueError(f"must be {what}, got {value!r}")
        return kind(number)

    return Annotated[Any, PlainValidator(check)]


class Hyperparameters(_Wire):
    batch_size: _auto_or(int, 1, 1024) = None  # type: ignore[valid-type]
    compute_multiplier: _auto_or(float, 0, 8) = None  # type: ignore[valid-type]
    eval_interval: _auto_or(int, 1, 1_000_000) = None  # type: ignore[valid-type]
    eval_samples: _auto_or(int, 1, 100_000) = None  # type: ignore[valid-type]
    learning_rate_multiplier: _auto_or(float, 0, 100) = None  # type: ignore[valid-type]
    n_epochs: _auto_or(int, 1, 1000) = None  # type: ignore[valid-type]
    reasoning_effort: str | None = None


class Reinforcement(_Wire):
    grader: dict[str, Any]
    hyperparameters: Hyperparameters | None = None


class SupervisedHyperparameters(_Wire):
    batch_size: _auto_or(int, 1, 1024) = None  # type: ignore[valid-type]
    learning_rate_multiplier: _auto_or(float, 0, 100) = None  # type: ignore[valid-type]
    n_epochs: _auto_or(int, 1, 1000) = None  # type: ignore[valid-type]


class Supervised(_Wire):
    hyperparameters: SupervisedHyperparameters | None = None


class Method(_Wire):
    type: Literal["supervised", "dpo", "reinforcement"]
    reinforcement: Reinforcement | None = None
    supervised: Supervised | None = None
    dpo: dict[str, Any] | None = None


class CreateJob(_Wire):
    """`POST /v1/fine_tuning/jobs`, as the SDK's `JobCreateParams` describe it."""

    model: str = Field(..., min_length=1, max_length=200)
    training_file: str = Field(..., min_length=1, max_length=64)
    validation_file: str | None = Field(None, min_length=1, max_length=64)
    method: Method | None = None
    hyperparameters: dict[str, Any] | None = None
    integrations: list[Any] | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    suffix: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class Resolved:
    """A checked request: its grader (None: a supervised job) and every
    hyperparameter's value."""

    grader: OpenAIGrader | None
    hyperparameters: dict[str, Any]
    seed: int

    @property
    def supervised(self) -> bool:
        return self.grader is None


def is_supervised(body: CreateJob) -> bool:
    """Whether the request asks for supervised fine-tuning (OpenAI's default method)."""
    return body.method is None or body.method.type == "supervised"


def check_request(body: CreateJob) -> OpenAIGrader | None:
    """What a request asks that marlaas cannot honour, refused naming the field; returns
    the parsed grader (None for a supervised job)."""
    if body.model != BASE_MODEL:
        raise bad_request(
            f"model {body.model!r} is not available for fine-tuning: marlaas fine-tunes its "
            f"shared base model, named {BASE_MODEL!r} (GET /v1/models lists it)",
            "model",
            "model_not_available",
        )
    if body.hyperparameters is not None:
        raise bad_request(
            "the top-level hyperparameters are deprecated; give them as "
            "method.reinforcement.hyperparameters",
            "hyperparameters",
        )
    if body.integrations:
        raise bad_request(
            "integrations (Weights & Biases) are not supported; follow the job with "
            "GET /v1/fine_tuning/jobs/{id}/events or the marlaas dashboard",
            "integrations",
        )
    for key, value in (body.metadata or {}).items():
        if len(key) > 64 or len(value) > 512:
            raise bad_request(
                "metadata keys are at most 64 characters and values at most 512",
                f"metadata.{key[:64]}",
            )
    method = body.method
    if method is not None:
        given = [k for k in ("reinforcement", "supervised", "dpo") if getattr(method, k)]
        wrong = [k for k in given if k != method.type]
        if wrong:
            raise bad_request(
                f"method.{wrong[0]} is given, but method.type is {method.type}; give the "
                "settings of the method the type names",
                f"method.{wrong[0]}",
            )
    if method is None or method.type == "supervised":
        return None
    if method.type == "dpo":
        raise bad_request(
            "the dpo method is not supported: marlaas trains with supervised (cross-entropy "
            "on the assistant turns) or reinforcement fine-tuning; give method: {type: "
            "supervised, supervised: {hyperparameters}} or {type: reinforcement, ...}",
            "method.type",
        )
    if method.reinforcement is None:
        raise bad_request(
            "method.reinforcement is missing: give its grader (and hyperparameters)",
            "method.reinforcement",
        )
    where = "method.reinforcement.grader"
    try:
        grader = parse_openai_grader(method.reinforcement.grader, where)
        check_runnable(grader)
    except OpenAIGraderError as e:
        raise bad_request(str(e), e.param) from None
    except GraderError as e:
        raise bad_request(str(e), where) from None
    effort = (method.reinforcement.hyperparameters or Hyperparameters()).reasoning_effort
    if effort is not None:
        raise bad_request(
            "reasoning_effort cannot be honoured: marlaas models do not reason in a "
            "separate channel; leave it out",
            "method.reinforcement.hyperparameters.reasoning_effort",
        )
    return grader


def _pick(value: Any, default: Any) -> Any:
    return default if value is None or value == "auto" else value


def eval_rows(train_rows: int, validation_rows: int | None) -> tuple[int, int]:
    """(rows trained on, rows held out): the validation file, else the training file's
    deterministic split (as `DatasetSpec.eval_fraction` makes it)."""
    if validation_rows is not None:
        return train_rows, validation_rows
    return split_sizes(train_rows)


def split_sizes(rows: int) -> tuple[int, int]:
    """The (train, eval) sizes `envs.datasets.split_examples` gives `rows` examples at
    `EVAL_FRACTION` (a test holds the two to the same numbers)."""
    n_eval = round(rows * EVAL_FRACTION)
    if rows >= 2:
        n_eval = min(max(n_eval, 1), rows - 1)
    return rows - n_eval, n_eval


def resolve(
    body: CreateJob, grader: OpenAIGrader | None, train_rows: int, validation_rows: int | None
) -> Resolved:
    """Every hyperparameter's value for files of these sizes."""
    if grader is None:
        return _resolve_supervised(body, train_rows, validation_rows)
    hp = (body.method.reinforcement.hyperparameters if body.method and body.method.reinforcement else None) or Hyperparameters()  # fmt: skip
    trained, held = eval_rows(train_rows, validation_rows)
    batch = int(_pick(hp.batch_size, min(DEFAULT_BATCH, trained)))
    epochs = int(_pick(hp.n_epochs, 1))
    steps = max(1, math.ceil(epochs * trained / batch))
    interval = hp.eval_interval if isinstance(hp.eval_interval, int) else None
    values = {
        "n_epochs": epochs,
        "batch_size": batch,
        "learning_rate_multiplier": float(_pick(hp.learning_rate_multiplier, 1.0)),
        "compute_multiplier": float(_pick(hp.compute_multiplier, 1.0)),
        "eval_interval": interval or steps,
        "eval_samples": min(int(_pick(hp.eval_samples, DEFAULT_EVAL_SAMPLES)), max(held, 1)),
        "reasoning_effort": None,
        "steps": steps,
    }
    return Resolved(grader, values, _seed(body))


def _seed(body: CreateJob) -> int:
    return body.seed if body.seed is not None else secrets.randbelow(2**31)


def _resolve_supervised(body: CreateJob, train_rows: int, validation_rows: int | None) -> Resolved:
    method = body.method
    hp = (method.supervised.hyperparameters if method and method.supervised else None) or SupervisedHyperparameters()  # fmt: skip
    trained, held = eval_rows(train_rows, validation_rows)
    batch = int(_pick(hp.batch_size, min(DEFAULT_SFT_BATCH, trained)))
    epochs = int(_pick(hp.n_epochs, DEFAULT_SFT_EPOCHS))
    per_epoch = max(1, math.ceil(trained / batch))
    values = {
        "n_epochs": epochs,
        "batch_size": batch,
        "learning_rate_multiplier": float(_pick(hp.learning_rate_multiplier, 1.0)),
        "steps": per_epoch * epochs,
        "steps_per_epoch": per_epoch,
        "eval_rows": min(max(held, 1), MAX_SFT_EVAL_ROWS),
    }
    return Resolved(None, values, _seed(body))


def _supervised_spec(body: CreateJob, resolved: Resolved) -> JobSpec:
    hp = resolved.hyperparameters
    default_lr = SFTSpec.model_fields["learning_rate"].default
    steps, per_epoch = hp["steps"], hp["steps_per_epoch"]
    every = per_epoch if per_epoch < steps else 0
    raw = {
        "name": f"ft-{(body.suffix or 'sft')[:48]}-{secrets.token_hex(4)}",
        "task": {
            "type": "dataset",
            "path": body.training_file,
            "eval_fraction": 0.0 if body.validation_file else EVAL_FRACTION,
            "eval_path": body.validation_file,
            "seed": resolved.seed,
        },
        "algorithm": {
            "type": "sft",
            "batch_size": hp["batch_size"],
            "learning_rate": default_lr * hp["learning_rate_multiplier"],
        },
        "steps": steps,
        "eval_every": every,
        "eval_episodes": hp["eval_rows"],
        "checkpoint_every": every,
        "seed": resolved.seed,
    }
    try:
        return _validated_spec(raw)
    except ValidationError as e:
        raise bad_request(
            f"these hyperparameters make no valid marlaas job: {describe_problems(e)}",
            "method.supervised.hyperparameters",
        ) from None


def job_spec(body: CreateJob, resolved: Resolved) -> JobSpec:
    """The marlaas job of a checked request (`check_request`, then `resolve`)."""
    if resolved.grader is None:
        return _supervised_spec(body, resolved)
    hp = resolved.hyperparameters
    default_lr = GRPOSpec.model_fields["learning_rate"].default
    group = min(64, max(2, round(DEFAULT_GROUP * hp["compute_multiplier"])))
    tag = body.suffix or "rft"
    steps = hp["steps"]
    every = hp["eval_interval"] if hp["eval_interval"] < steps else 0
    task: dict[str, Any] = {
        "type": "dataset",
        "path": body.training_file,
        # OpenAI's rows: chat messages through the base's chat template, no reference
        # (the grader reads the row's own fields).
        "format": "chat",
        "reference_field": None,
        "grader": {"type": "openai", "grader": _GRADER.dump_python(resolved.grader, mode="json")},
        "eval_fraction": 0.0 if body.validation_file else EVAL_FRACTION,
        "eval_path": body.validation_file,
        "seed": resolved.seed,
    }
    try:
        return _validated_spec(
            {
                "name": f"ft-{tag[:48]}-{secrets.token_hex(4)}",
                "task": task,
                "algorithm": {
                    "group_size": group,
                    "prompts_per_step": hp["batch_size"],
                    "learning_rate": default_lr * hp["learning_rate_multiplier"],
                },
                "steps": steps,
                "eval_every": every,
                "eval_episodes": hp["eval_samples"],
                "checkpoint_every": every,
                "seed": resolved.seed,
            }
        )
    except ValidationError as e:  # a combination the job spec refuses
        raise bad_request(
            f"these hyperparameters make no valid marlaas job: {describe_problems(e)}",
            "method.reinforcement.hyperparameters",
        ) from None


def _validated_spec(raw: dict[str, Any]) -> JobSpec:
    return JobSpec.model_validate(raw)


def method_record(resolved: Resolved) -> dict[str, Any]:
    """The job's `method` as answered: the grader and the resolved hyperparameters."""
    if resolved.grader is None:
        keys = ("batch_size", "learning_rate_multiplier", "n_epochs")
        chosen = {k: resolved.hyperparameters[k] for k in keys}
        return {"type": "supervised", "supervised": {"hyperparameters": chosen}}
    hp = {k: v for k, v in resolved.hyperparameters.items() if k != "steps"}
    return {
        "type": "reinforcement",
        "reinforcement": {
            "grader": _GRADER.dump_python(resolved.grader, mode="json"),
            "hyperparameters": hp,
        },
    }
