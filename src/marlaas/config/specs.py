"""Specs shared by every stage. Configs are data: each field is documented, cross-field
rules live in validators, derived values are properties.

Every field is bounded, so that a spec that validates describes work of bounded cost:
numbers are finite (`allow_inf_nan=False` on every spec), integers are real integers
(a JSON `true` is not 1), strings and lists have a longest length, and each limit is in
the field's description and in the error message. The service bounds a job further by
the machine it runs on and by the tenant's quotas (`marlaas.service.admission`).
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from marlaas.errors import ConfigError

#: Largest seed: torch's generators take 64-bit seeds; a JSON integer beyond it would
#: only fail once the job runs.
MAX_SEED = 2**63 - 1
#: Longest simulated tool latency, seconds (well below the pipeline's env timeout).
MAX_TOOL_LATENCY_S = 60.0


def integer_only(value: object) -> object:
    """Let integers through, and integral numbers such as 4.0 (JSON Schema's integers);
    refuse booleans and strings, which pydantic's lax mode would read as 1 or 4."""
    if isinstance(value, bool | str | bytes):
        raise ValueError(f"must be an integer, not {type(value).__name__} {value!r:.40}")
    return value


def number_only(value: object) -> object:
    """Let numbers through; refuse booleans and strings (lax mode reads `true` as 1.0)."""
    if isinstance(value, bool | str | bytes):
        raise ValueError(f"must be a number, not {type(value).__name__} {value!r:.40}")
    return value


#: An integer that is one: `true` and `"4"` are refused instead of read as 1 and 4.
Int = Annotated[int, BeforeValidator(integer_only)]
#: A number that is one: `true` and `"0.5"` are refused.
Float = Annotated[float, BeforeValidator(number_only)]
# Bounds go before the validator in `Annotated`: after it, pydantic writes them into the
# JSON schema as raw `ge`/`le` keys instead of `minimum`/`maximum`.
#: A seed: a non-negative 64-bit integer.
Seed = Annotated[int, Field(ge=0, le=MAX_SEED), BeforeValidator(integer_only)]
#: A short, non-empty name (a module, a field, a stop string).
ShortStr = Annotated[str, Field(min_length=1, max_length=128)]

#: `target_modules` that names every linear layer of the base but its output head (as
#: PEFT's own shorthand does).
ALL_LINEAR = "all-linear"

#: LoRA targets as a spec gives them: leaf names of the base's linear layers (`q_proj`,
#: `query_key_value`, `c_attn`, ...), `"all-linear"`, or None (the default: the run's
#: default, else `"all-linear"`). `marlaas.model.arch.resolve_targets` turns them into
#: the leaf names of one base, in its module order.
TargetModules = (
    Annotated[tuple[Annotated[str, Field(min_length=1, max_length=128)], ...], Field(max_length=64)]
    | Literal["all-linear"]
    | None
)

#: The base model's weights in memory: `auto` is the checkpoint's own dtype where the
#: device computes it (`model.base.resolve_dtype`); on the CPU a half dtype is the linear
#: layers' weights only, over float32 activations (`marlaas.model.mixed`).
ModelDType = Literal["auto", "float32", "bfloat16", "float16"]

#: The help text of the command line's `--dtype`.
DTYPE_HELP = (
    "The base's weights: auto (the checkpoint's dtype where the device computes it: "
    "on a CPU bfloat16 only with native bfloat16, else float32), float32, bfloat16 or "
    "float16 (on the CPU: the linear layers' weights only, activations stay float32). "
    "LoRA weights and log-probs stay float32."
)


def check_dtype(value: str, option: str = "--dtype") -> ModelDType:
    """`value` as a `ModelDType`; `ConfigError` naming `option` otherwise."""
    for choice in ("auto", "float32", "bfloat16", "float16"):
        if value == choice:
            return choice
    raise ConfigError(f"{option} must be auto, float32, bfloat16 or float16; got {value!r}")


def check_target_names(value: TargetModules) -> TargetModules:
    """Explicit target names must be non-empty leaf names (no dots, no blanks)."""
    if value is None or isinstance(value, str):
        return value
    if not value:
        raise ValueError("give at least one module name, 'all-linear', or leave it unset")
    for name in value:
        if not name.strip() or "." in name or name != name.strip():
            raise ValueError(
                f"{name!r} is not a module's leaf name; give names like 'q_proj' (the last "
                "part of a module's path), or 'all-linear'"
            )
    return tuple(dict.fromkeys(value))


def parse_target_modules(text: str | None, option: str = "--target-modules") -> TargetModules:
    """A command line's target modules: comma-separated leaf names, 'all-linear', or
    None (unset); `ConfigError` naming `option` for anything else."""
    if text is None:
        return None
    if text.strip() == "all-linear":
        return "all-linear"
    try:
        return check_target_names(tuple(part.strip() for part in text.split(",")))
    except ValueError as e:
        raise ConfigError(f"{option}: {e} (comma-separated, e.g. q_proj,v_proj)") from None


def read_yaml(source: Path, label: str = "") -> object:
    """The YAML (or JSON) document in `source`; `ConfigError` when it cannot be read
    or parsed. `label` ("the Ray spec ") prefixes the file's name in messages."""
    import yaml

    try:
        return yaml.safe_load(source.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read {label}{source}: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{label}{source} is not valid YAML: {e}") from e


def describe_problems(error: ValidationError) -> str:
    """A validation error's problems on one line: `field.path: message; ...`."""
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg']}"
        for err in error.errors()
    )


class Spec(BaseModel):
    """Base of all specs: unknown fields are errors, instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    def updated(self, **changes: Any) -> Self:
        """A copy with `changes`, validated as a new spec (its validators run again;
        `model_copy(update=...)` would skip them). Unchanged fields keep their values."""
        fields = {name: getattr(self, name) for name in self.model_fields_set}
        return self.model_validate({**fields, **changes})


class LoRASpec(Spec):
    """A tenant's LoRA adapter shape."""

    rank: Int = Field(
        8,
        ge=0,
        le=256,
        description="LoRA rank r (0-256); 0 means the plain base. A "
        "server allows at most its engine's max rank.",
    )
    alpha: Float = Field(
        16.0, gt=0, le=1e6, description="LoRA alpha (0-1e6); the update is scaled by alpha/r."
    )
    target_modules: TargetModules = Field(
        None,
        description="Leaf names of the base's linear layers that get an adapter (e.g. "
        "[q_proj, v_proj]; GPT-NeoX: query_key_value, GPT-2: c_attn, ...; at most 64), or "
        "'all-linear' (every linear layer but the output head). Unset: the run's "
        "`default_target_modules`, else 'all-linear'. MoE expert weights are fused, "
        "frozen parameters, not linear layers: they cannot be targeted. A server checks "
        "them against its base model's layers when the job is submitted.",
    )
    use_rslora: bool = Field(False, description="Scale by alpha/sqrt(r) instead of alpha/r.")

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: TargetModules) -> TargetModules:
        return check_target_names(v)

    @property
    def scaling(self) -> float:
        if self.rank == 0:
            return 0.0
        return self.alpha / (self.rank**0.5 if self.use_rslora else self.rank)


class SamplingSpec(Spec):
    """How rollouts are sampled."""

    temperature: Float = Field(
        1.0, ge=0.0, le=10.0, description="Softmax temperature (0-10); 0 means greedy decoding."
    )
    top_p: Float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass (0-1].")
    top_k: Int = Field(
        0, ge=0, le=1_000_000, description="Keep the k most likely tokens; 0 disables."
    )
    max_new_tokens: Int = Field(
        48,
        ge=1,
        le=32768,
        description="Tokens per model turn (1-32768); prompt plus turns must also fit the "
        "served model's context.",
    )
    stop: tuple[ShortStr, ...] = Field(
        (), max_length=16, description="Extra stop strings for every turn (at most 16)."
    )


#: An Adam beta.
Beta = Annotated[float, Field(ge=0.0, lt=1.0), BeforeValidator(number_only)]


class GRPOSpec(Spec):
    """Group-relative policy optimisation (Shao et al. 2024) and its common variants.

    The one algorithm family today, so `JobSpec.algorithm` is this type; `type` already
    keys it, so a second family makes that field a union discriminated on `type`."""

    type: Literal["grpo"] = "grpo"
    group_size: Int = Field(
        8,
        ge=2,
        le=1024,
        description="G: samples per prompt (2-1024). A group is sampled together, so a "
        "server also bounds it by its engine's rows; G x P is bounded by the tenant's "
        "`max_samples_per_step` quota.",
    )
    prompts_per_step: Int = Field(
        4, ge=1, le=1024, description="P: prompts per optimizer step (1-1024)."
    )
    learning_rate: Float = Field(
        3e-4,
        gt=0,
        le=1.0,
        description="AdamW learning rate, in (0, 1]. Adam moves every LoRA element by about lr per step "
        "whatever the gradient's size, so with the sparse, noisy GRPO gradient most of each "
        "step is noise: on the 0.77M-param embedded base (rank 8, all 7 projections), "
        ">= 1e-3 lowers held-out accuracy within 16 steps and 3e-3 collapses it, while "
        "3e-4..5e-4 is stable (greedy +0.05..0.08 on calculator).",
    )
    betas: tuple[Beta, Beta] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1).")
    weight_decay: Float = Field(0.0, ge=0, le=10.0, description="AdamW weight decay (0-10).")
    max_grad_norm: Float = Field(
        1.0, gt=0, le=1e6, description="Clip each step's gradient to this norm (0-1e6]."
    )
    clip_low: Float = Field(0.2, ge=0, description="PPO clip epsilon below 1, in [0, 1).")
    clip_high: Float = Field(
        0.2, ge=0, le=10.0, description="PPO clip epsilon above 1 (0-10; DAPO: 0.28)."
    )
    scale_rewards: bool = Field(True, description="Divide advantages by the group std.")
    loss_norm: Literal["token", "sequence", "constant"] = Field(
        "token",
        description="token: DAPO token-level mean; sequence: GRPO per-sequence mean; "
        "constant: Dr. GRPO, divide by a fixed token budget.",
    )
    kl_coef: Float = Field(
        0.0, ge=0, le=100.0, description="KL penalty to the base policy (0-100); 0 disables."
    )
    kl_estimator: Literal["k1", "k3"] = Field("k3", description="KL estimator (Schulman).")
    tis_cap: Annotated[float, Field(gt=0, le=1e6), BeforeValidator(number_only)] | None = Field(
        None, description="Truncated importance sampling cap (0-1e6]; None disables."
    )
    max_staleness: Int = Field(
        1,
        ge=0,
        le=64,
        description="Train only on data sampled with adapter versions >= step - this (0-64; "
        "a server allows at most its own limit).",
    )

    @model_validator(mode="after")
    def _check(self) -> GRPOSpec:
        if self.clip_low >= 1.0:
            raise ValueError("clip_low must be below 1 (ratios are clipped to [1-clip_low, ...])")
        return self

    @property
    def samples_per_step(self) -> int:
        return self.group_size * self.prompts_per_step


class SFTSpec(Spec):
    """Supervised fine-tuning: the weighted next-token cross-entropy of the rows'
    completion (assistant) tokens, normalised per token over each step's batch."""

    type: Literal["sft"] = "sft"
    batch_size: Int = Field(
        8,
        ge=1,
        le=1024,
        description="Examples per optimizer step (1-1024); the data are read in order, "
        "epoch after epoch, each epoch shuffled by the job's seed. The step's tokens are "
        "bounded by the tenant's `max_tokens_per_step` quota.",
    )
    learning_rate: Float = Field(
        2e-4, gt=0, le=1.0, description="AdamW learning rate, in (0, 1] (LoRA SFT's usual 2e-4)."
    )
    betas: tuple[Beta, Beta] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1).")
    weight_decay: Float = Field(0.0, ge=0, le=10.0, description="AdamW weight decay (0-10).")
    max_grad_norm: Float = Field(
        1.0, gt=0, le=1e6, description="Clip each step's gradient to this norm (0-1e6]."
    )


#: One end of a tool latency range, in seconds.
Latency = Annotated[float, Field(ge=0.0, le=MAX_TOOL_LATENCY_S), BeforeValidator(number_only)]


class TaskSpec(Spec):
    """A built-in task family and its knobs."""

    type: Literal["builtin"] = "builtin"
    family: str = Field(
        ...,
        min_length=1,
        max_length=64,
        description="Name of a built-in task family, e.g. 'arithmetic'.",
    )
    format: Literal["text", "chat"] = Field(
        "text",
        description="text: the built-in text protocol (`Q: ...` prompts, one line per turn, "
        "tool calls as `calc 1+2` lines), what the embedded base knows; chat: every turn "
        "rendered with the base's chat template, tool calls in the template's own format "
        "(Qwen-style <tool_call> tags, or JSON function calls), for chat models.",
    )
    seed: Seed = Field(0, description="Seed of the train/eval splits (0 to 2**63-1).")
    tool_latency_s: tuple[Latency, Latency] = Field(
        (0.0, 0.0),
        description="Range of simulated tool latency, in seconds (each end 0-60): every "
        "tool call waits a uniform draw from it. The two ends may come in either order.",
    )
    options: dict[ShortStr, Int | Float | Annotated[str, Field(max_length=256)]] = Field(
        default_factory=dict,
        max_length=32,
        description="Family-specific knobs, e.g. {'max_digits': 2} for arithmetic (at most "
        "32; each family checks its own ranges).",
    )

    @field_validator("tool_latency_s")
    @classmethod
    def _ordered(cls, value: tuple[float, float]) -> tuple[float, float]:
        # A range is a range whichever end comes first: accept both orders.
        lo, hi = sorted(value)
        return (lo, hi)


def check_grade_source(text: str, field: str, signature: str, params: Sequence[str]) -> None:
    """`ValueError` unless `text` (the `field` of a python grader) parses and defines a
    top-level plain `def grade(<signature>)` callable with `params` positionally."""
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        raise ValueError(
            f"{field} does not parse: {exc.msg} at line {exc.lineno}; fix the syntax"
        ) from exc
    grades = [
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "grade"
    ]
    if not grades:
        raise ValueError(
            f"{field} defines no top-level function `grade`; add `def grade({signature}) -> float`"
        )
    fn = grades[-1]
    if isinstance(fn, ast.AsyncFunctionDef):
        raise ValueError("`grade` must be a plain `def`, not `async def`")
    args, n = fn.args, len(params)
    positional = len(args.posonlyargs) + len(args.args)
    required = positional - len(args.defaults)
    if (positional < n and args.vararg is None) or required > n:
        count = {2: "two", 3: "three"}.get(n, str(n))
        raise ValueError(
            f"`grade` must take exactly {count} positional arguments ({', '.join(params)})"
        )
    if any(d is None for d in args.kw_defaults):
        raise ValueError("`grade` must not have required keyword-only arguments")
