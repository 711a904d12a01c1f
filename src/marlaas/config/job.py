"""A tenant's RL job, and a run of several jobs.

`JobSpec` is what a tenant submits (over HTTP or in a JOBS.yaml): the data and its
grader, the adapter shape, the algorithm and the schedule. `PipelineSpec` is what every
pipeline is built from (the shared base, the engine and trainer sizes, the window of
versions); `RunSpec`, what `marlaas run` and the benches execute, is a `PipelineSpec`
plus its jobs. All are pure data (no torch import) and are written next to a run's
outputs, resolved.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic.config import JsonDict

from marlaas.config.graders import GraderSpec
from marlaas.config.ray import RaySpec
from marlaas.config.specs import (
    Float,
    GRPOSpec,
    Int,
    LoRASpec,
    ModelDType,
    SamplingSpec,
    Seed,
    SFTSpec,
    ShortStr,
    Spec,
    TargetModules,
    TaskSpec,
    check_target_names,
    describe_problems,
    integer_only,
    read_yaml,
)
from marlaas.errors import ConfigError

#: What a job, tenant or dataset name looks like. `\Z`, not `$`: `$` also matches before
#: a final newline, which let "name\n" through.
NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z"
NAME_RULE = "use 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit"
_NAME = re.compile(NAME_RE)
#: The same rule for the JSON schema (whose regex dialect has no `\Z`; `$` is the end).
NAME_PATTERN = "^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
NAME_SCHEMA: JsonDict = {"pattern": NAME_PATTERN}
#: Most held-out episodes one eval may ask (the tenant's `max_eval_episodes` quota may
#: allow fewer).
MAX_EVAL_EPISODES = 10_000
#: Most optimizer steps of a job, and the largest step interval.
MAX_STEPS = 1_000_000


#: How many checkpoints to keep (bounds before the validator: see `specs.Seed`).
KeepCount = Annotated[int, Field(ge=1, le=MAX_STEPS), BeforeValidator(integer_only)]


def check_name(value: str) -> str:
    """`value` if it is a valid name, else `ValueError` with the rule."""
    if not _NAME.fullmatch(value):
        raise ValueError(NAME_RULE)
    return value


class DatasetSpec(Spec):
    """User data: a JSONL file of prompt + reference rows, scored by a declarative grader
    (an RL job), or of training conversations (a supervised job: chat `messages` whose
    assistant turns are the targets, or `prompt` + `completion` text rows)."""

    type: Literal["dataset"] = "dataset"
    path: str = Field(
        ...,
        min_length=1,
        max_length=4096,
        description="The JSONL file (one JSON object per line): a path for `marlaas run`, "
        "the name of one of your uploaded datasets for the service.",
    )
    prompt_field: ShortStr = Field(
        "prompt",
        description="Row field holding the prompt text. Rows may instead carry `messages` "
        "(OpenAI chat format), rendered with the base's chat template. A supervised job's "
        "text rows hold the target in `completion`.",
    )
    reference_field: ShortStr | None = Field(
        "reference",
        description="Row field holding the reference; None: rows have none (the grader "
        "gets '' and reads the row's own fields, as an OpenAI grader does). A supervised "
        "job reads no reference.",
    )
    grader: GraderSpec | None = Field(
        None,
        description="How a completion is scored against the row; required by an RL job, "
        "refused by a supervised one (whose rows carry their own target completions).",
    )
    eval_fraction: Float = Field(
        0.1, ge=0.0, lt=1.0, description="Fraction of rows held out for eval, in [0, 1)."
    )
    eval_path: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="A second JSONL file (same fields) whose rows are the eval set; "
        "eval_fraction must then be 0.",
    )
    format: Literal["auto", "text", "chat"] = Field(
        "auto",
        description="auto: chat rows (`messages`) go through the base's chat template and "
        "text rows are sent as they are; chat: text rows too, as one user message; text: "
        "no template (chat rows are refused). A supervised job under auto renders chat "
        "rows in the plain `Q:`/`A:` lines on a base without a chat template.",
    )
    seed: Seed = Field(0, description="Seed of the train/eval split (0 to 2**63-1).")

    @model_validator(mode="after")
    def _eval_set(self) -> DatasetSpec:
        if self.eval_path is not None and self.eval_fraction > 0:
            raise ValueError(
                "eval_path gives the eval rows, so eval_fraction must be 0 (no rows of "
                "the training file are held out)"
            )
        return self


def _data_kind(value: Any) -> str:
    """`type` may be left out for a built-in task: `{family: arithmetic}` is enough."""
    if isinstance(value, dict):
        return str(value.get("type", "builtin"))
    return str(getattr(value, "type", "builtin"))


def _algorithm(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """The algorithm variant its `type` names (left out: GRPO, the default), validated
    as that variant only, so that errors name the field as given (`algorithm.group_size`,
    not the variant's tag as a union's errors would)."""
    if isinstance(value, GRPOSpec | SFTSpec):
        return value
    if not isinstance(value, dict):
        return handler(value)
    kind = value.get("type", "grpo")
    if not isinstance(kind, str) or kind not in _ALGORITHMS:
        raise ValueError(f"type must be one of {', '.join(_ALGORITHMS)}, got {kind!r:.40}")
    return _ALGORITHMS[kind].model_validate(value)


_ALGORITHMS: dict[str, type[GRPOSpec] | type[SFTSpec]] = {"grpo": GRPOSpec, "sft": SFTSpec}
#: The job's algorithm, keyed on `type`: `grpo` (RL, the default) or `sft` (supervised).
AlgorithmChoice = Annotated[GRPOSpec | SFTSpec, WrapValidator(_algorithm)]


DataSpec = Annotated[
    Annotated[TaskSpec, Tag("builtin")] | Annotated[DatasetSpec, Tag("dataset")],
    Discriminator(_data_kind),
]


class JobSpec(Spec):
    """One tenant's fine-tuning job: RL (GRPO, the default) or supervised (`sft`)."""

    name: str = Field(
        ...,
        description="Job name: letters, digits, '_', '.', '-' (1-64), starting with a letter "
        "or digit.",
        json_schema_extra=NAME_SCHEMA,
    )
    task: DataSpec = Field(..., description="A built-in task family or a user dataset.")
    lora: LoRASpec = Field(default_factory=LoRASpec, description="The tenant's adapter.")
    algorithm: AlgorithmChoice = Field(
        default_factory=GRPOSpec,
        description="The algorithm and its knobs: GRPO (`type: grpo`, the default) or "
        "supervised fine-tuning (`type: sft`, on a dataset's target completions).",
    )
    sampling: SamplingSpec = Field(
        default_factory=SamplingSpec,
        description="Rollout sampling per model turn (RL; a supervised job samples nothing).",
    )
    steps: Int = Field(20, ge=1, le=MAX_STEPS, description="Optimizer steps to run (1-1,000,000).")
    eval_every: Int = Field(
        0,
        ge=0,
        le=MAX_STEPS,
        description="Evaluate every this many steps (0: only before and after).",
    )
    eval_episodes: Int = Field(
        64,
        ge=1,
        le=MAX_EVAL_EPISODES,
        description="Held-out episodes per eval (1-10,000; the tenant's `max_eval_episodes` "
        "quota may allow fewer); a supervised job's eval scores this many held-out rows.",
    )
    checkpoint_every: Int = Field(
        0,
        ge=0,
        le=MAX_STEPS,
        description="Checkpoint every this many steps (0: only at the end).",
    )
    keep_checkpoints: KeepCount | None = Field(
        None,
        description="Keep only the newest this many checkpoints, removing older ones as "
        "new ones land (None: the runner's default; the service keeps all).",
    )
    priority: Float = Field(
        1.0, gt=0.0, le=1000.0, description="Weight of this job's share of device time."
    )
    seed: Seed = Field(
        0, description="Seed of the adapter init, data order and sampling (0 to 2**63-1)."
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v)

    @property
    def supervised(self) -> bool:
        return isinstance(self.algorithm, SFTSpec)

    @property
    def grpo(self) -> GRPOSpec:
        """The job's GRPO settings; `ConfigError` for a supervised job (RL code only)."""
        if not isinstance(self.algorithm, GRPOSpec):
            raise ConfigError(f"job {self.name!r} is a supervised job: it has no GRPO settings")
        return self.algorithm

    @model_validator(mode="after")
    def _check(self) -> JobSpec:
        if isinstance(self.algorithm, SFTSpec):
            if not isinstance(self.task, DatasetSpec):
                raise ValueError(
                    "a supervised job (algorithm.type sft) trains on a dataset's target "
                    "completions: give task as {type: dataset, path: ...}, not a built-in family"
                )
            if self.task.grader is not None:
                raise ValueError(
                    "task.grader: a supervised job trains on its rows' own completions and "
                    "grades nothing; remove the grader (or use algorithm.type grpo)"
                )
            return self
        if isinstance(self.task, DatasetSpec) and self.task.grader is None:
            raise ValueError(
                "task.grader is required by an RL job: say how a completion is scored "
                "against the row (or use algorithm.type sft on rows with target completions)"
            )
        if self.sampling.temperature == 0:
            raise ValueError(
                "sampling.temperature must be > 0 for RL: greedy rollouts give every sample "
                "of a group the same reward, hence zero advantage"
            )
        return self


#: `PipelineSpec.max_staleness` of a pipeline whose jobs come later (the service).
DEFAULT_MAX_STALENESS = 4


class EngineSpec(Spec):
    """Sizes and seed of the shared rollout engine."""

    max_batch_size: Int = Field(
        64, ge=1, le=4096, description="Rows decoded per iteration (1-4096)."
    )
    adapter_slots: Int = Field(
        64, ge=1, le=4096, description="Adapters resident for compute (1-4096)."
    )
    max_rank: Int = Field(
        16, ge=1, le=256, description="Largest LoRA rank any tenant may use (1-256)."
    )
    max_prefill_tokens: Int = Field(
        4096, ge=1, le=2**24, description="Prompt tokens the engine admits per iteration."
    )
    seed: Seed = Field(
        0,
        description="Seed of the engine's own sampling generator, for requests without a "
        "seed of their own (Ray engine replica i: this + i).",
    )


class TrainerSpec(Spec):
    """Sizes of the shared multi-lane trainer."""

    max_tokens_per_microbatch: Int = Field(
        8192,
        ge=64,
        le=2**24,
        description="Token budget of one forward/backward (bounds memory); one sequence "
        "(prompt and every turn) must fit in it.",
    )


class PipelineSpec(Spec):
    """What a pipeline is built from, whatever runs on it: the shared base, where the
    stages run, the engine and trainer sizes and the window of adapter versions. A
    long-lived pipeline (the service, `PipelineRuntime`) takes one as it is and gets its
    jobs later; a `RunSpec` is one plus its fixed jobs."""

    base_model: str | None = Field(
        None, description="Hugging Face causal-LM directory; None: the embedded base."
    )
    dtype: ModelDType = Field(
        "auto",
        description="The base's weights in memory: float32, bfloat16 or float16; auto: the "
        "checkpoint's own dtype where the device computes it (on a CPU bfloat16 only with "
        "native bfloat16, else float32). On the CPU a half "
        "dtype is the linear layers' weights only, over float32 activations. LoRA "
        "weights, optimizer state and log-probs stay float32 whatever the base.",
    )
    default_target_modules: TargetModules = Field(
        None,
        description="`lora.target_modules` of the jobs that leave it unset: leaf names of "
        "the base's linear layers or 'all-linear'; None: 'all-linear'.",
    )
    backend: Literal["inprocess", "ray"] = Field("inprocess", description="Where stages run.")
    ray: RaySpec = Field(
        default_factory=RaySpec, description="Ray cluster and actor placement (backend: ray)."
    )
    max_active_tenants: int = Field(
        32, ge=1, le=4096, description="Admission cap; further jobs wait in a queue."
    )
    max_staleness: Int | None = Field(
        None,
        ge=0,
        le=64,
        description="Largest `algorithm.max_staleness` a job may ask (0-64); it sizes the "
        "window of adapter versions the sampler keeps (`versions_kept`). None: the largest "
        f"of the run's jobs; a pipeline without fixed jobs: {DEFAULT_MAX_STALENESS}.",
    )
    engine: EngineSpec = Field(default_factory=EngineSpec)
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)

    @field_validator("default_target_modules")
    @classmethod
    def _targets(cls, v: TargetModules) -> TargetModules:
        return check_target_names(v)

    @property
    def staleness_limit(self) -> int:
        """The largest `algorithm.max_staleness` a job of this pipeline may have."""
        return DEFAULT_MAX_STALENESS if self.max_staleness is None else self.max_staleness

    @property
    def versions_kept(self) -> int:
        """Adapter versions the sampler keeps per tenant: the newest, the one a train
        step in flight trains on, and the `staleness_limit` stale ones a batch may still
        hold. The one place this window is derived."""
        return self.staleness_limit + 2


class RunSpec(PipelineSpec):
    """A set of tenant jobs run together on one shared base (`marlaas run JOBS.yaml`):
    the pipeline's spec and its jobs."""

    jobs: tuple[JobSpec, ...] = Field(..., min_length=1, description="The tenants' jobs.")

    @property
    def staleness_limit(self) -> int:
        """`max_staleness` when given, else the largest of the RL jobs' (0 with none: a
        supervised job trains on its data, never on stale samples; the validator keeps
        every job within it)."""
        if self.max_staleness is not None:
            return self.max_staleness
        return max((job.grpo.max_staleness for job in self.jobs if not job.supervised), default=0)

    @model_validator(mode="after")
    def _check(self) -> RunSpec:
        names = [j.name for j in self.jobs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"job names must be unique; repeated: {', '.join(dup)}")
        too_big = [j.name for j in self.jobs if j.lora.rank > self.engine.max_rank]
        if too_big:
            raise ValueError(
                f"jobs {', '.join(too_big)} ask for a LoRA rank above engine.max_rank "
                f"({self.engine.max_rank}); raise engine.max_rank or lower their rank"
            )
        limit = self.staleness_limit
        stale = [j.name for j in self.jobs if not j.supervised and j.grpo.max_staleness > limit]
        if stale:
            raise ValueError(
                f"jobs {', '.join(stale)} ask for an algorithm.max_staleness above "
                f"max_staleness ({limit}); raise max_staleness or lower theirs"
            )
        return self


def load_run_spec(path: str | Path) -> RunSpec:
    """Read and validate a JOBS.yaml (or .json) file; errors name the file and field."""
    source = Path(path)
    raw = read_yaml(source)
    if isinstance(raw, list):  # a bare list of jobs
        raw = {"jobs": raw}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping with a `jobs:` list at the top level")
    try:
        return RunSpec.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"{source}: invalid run spec: {describe_problems(e)}") from e
