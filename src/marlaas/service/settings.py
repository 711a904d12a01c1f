"""The service's settings: where its state lives, its limits and default quotas.

Settings are data (a frozen pydantic model); `marlaas serve` builds them from its
options and the environment, tests build them directly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, field_validator

from marlaas.config.job import MAX_EVAL_EPISODES, EngineSpec, PipelineSpec, TrainerSpec
from marlaas.config.ray import RaySpec
from marlaas.config.specs import (
    ModelDType,
    Spec,
    TargetModules,
    check_target_names,
    integer_only,
)

ADMIN_KEY_ENV = "MARLAAS_ADMIN_KEY"
METRICS_TOKEN_ENV = "MARLAAS_METRICS_TOKEN"

# The type of each quota, shared by `QuotaSpec` and the admin's `QuotaPatch`.
ConcurrentJobs = Annotated[int, Field(ge=0, le=10_000), BeforeValidator(integer_only)]
TotalSteps = Annotated[int, Field(ge=0, le=10**12), BeforeValidator(integer_only)]
DatasetBytes = Annotated[int, Field(ge=0, le=2**50), BeforeValidator(integer_only)]
SamplesPerStep = Annotated[int, Field(ge=0, le=2**20), BeforeValidator(integer_only)]
EvalEpisodes = Annotated[int, Field(ge=0, le=MAX_EVAL_EPISODES), BeforeValidator(integer_only)]
TokensPerStep = Annotated[int, Field(ge=0, le=2**40), BeforeValidator(integer_only)]
InferenceRequests = Annotated[int, Field(ge=0, le=10_000), BeforeValidator(integer_only)]
InferenceTokens = Annotated[int, Field(ge=0, le=2**40), BeforeValidator(integer_only)]

#: What each quota limits (the description of its field here and in `QuotaPatch`).
QUOTA_DOCS = {
    "max_concurrent_jobs": "Jobs queued, running or paused at once (0-10,000).",
    "max_total_steps": "Optimizer steps over all the tenant's jobs; a cancelled or failed "
    "job counts only the steps it ran (0-10**12).",
    "max_dataset_bytes": "Bytes of all the tenant's uploaded datasets (0-2**50).",
    "max_samples_per_step": "Samples one optimizer step of one job may ask: "
    "algorithm.group_size x algorithm.prompts_per_step (0-2**20).",
    "max_eval_episodes": "Held-out episodes one eval of one job may ask (0-10,000).",
    "max_tokens_per_step": "Tokens one optimizer step of one job may sample and train: "
    "samples per step x (its longest prompt + max turns x sampling.max_new_tokens, at "
    "most the model's context) (0-2**40).",
    "max_inference_requests": "OpenAI-compatible inference requests of the tenant in "
    "flight at once (0-10,000).",
    "max_inference_tokens": "Tokens one inference request may ask to generate: prompts x "
    "n x max_tokens (0-2**40).",
}


class QuotaSpec(Spec):
    """Per-tenant limits. A new tenant gets the service's defaults unless told otherwise;
    the admin changes them with `PATCH /v1/admin/tenants/{name}/quotas`. Jobs are
    admitted by their cost (`service.admission`): a job whose step or eval would ask
    more than these is refused with 429 naming the quota, before anything runs."""

    max_concurrent_jobs: ConcurrentJobs = Field(4, description=QUOTA_DOCS["max_concurrent_jobs"])
    max_total_steps: TotalSteps = Field(10_000, description=QUOTA_DOCS["max_total_steps"])
    max_dataset_bytes: DatasetBytes = Field(
        100 * 2**20, description=QUOTA_DOCS["max_dataset_bytes"]
    )
    max_samples_per_step: SamplesPerStep = Field(
        1024, description=QUOTA_DOCS["max_samples_per_step"]
    )
    max_eval_episodes: EvalEpisodes = Field(1024, description=QUOTA_DOCS["max_eval_episodes"])
    max_tokens_per_step: TokensPerStep = Field(
        262_144, description=QUOTA_DOCS["max_tokens_per_step"]
    )
    max_inference_requests: InferenceRequests = Field(
        8, description=QUOTA_DOCS["max_inference_requests"]
    )
    max_inference_tokens: InferenceTokens = Field(
        65_536, description=QUOTA_DOCS["max_inference_tokens"]
    )


class ServiceSettings(Spec):
    """Where the service keeps its state and how much it accepts."""

    data_dir: Path = Field(
        Path("marlaas-data"), description="Holds the SQLite database and the artifacts."
    )
    db_url: str | None = Field(
        None,
        description="SQLAlchemy URL, e.g. postgresql+psycopg://user@host/db; "
        "None: SQLite at <data_dir>/marlaas.db.",
    )
    admin_key: str | None = Field(
        None,
        description="The admin key; None: one is generated at first start, printed once "
        "and stored hashed.",
        repr=False,
    )
    metrics_token: str | None = Field(
        None,
        description="A bearer token that may read `/metrics` (for a Prometheus scraper), "
        "besides the admin key; None: only the admin key may.",
        repr=False,
    )
    max_body_bytes: int = Field(
        1 * 2**20, ge=1024, description="Largest JSON request body; larger answers 413."
    )
    max_upload_bytes: int = Field(
        256 * 2**20, ge=1024, description="Largest dataset upload; larger answers 413."
    )
    max_lora_rank: int = Field(16, ge=1, le=256, description="Largest LoRA rank a job may ask.")
    max_staleness: int = Field(
        4, ge=0, le=64, description="Largest `algorithm.max_staleness` a job may ask."
    )
    max_batch_rows: int = Field(
        64,
        ge=1,
        le=4096,
        description="Rows the engine decodes at once (its max_batch_size); a job's group "
        "and an inference request's prompts x n must fit in them.",
    )
    max_tokens_per_microbatch: int = Field(
        8192,
        ge=64,
        le=2**24,
        description="The trainer's token budget of one forward/backward; one sequence of a "
        "job (prompt and every turn) must fit in it.",
    )
    env_timeout_s: float = Field(
        120.0,
        gt=0,
        le=3600,
        description="Limit of one environment call (tool, grader); a job's tool latency "
        "must stay below it.",
    )
    shutdown_timeout_s: float = Field(
        5.0,
        gt=0,
        le=600,
        description="Time the job backend gets at shutdown to checkpoint its running jobs "
        "and stop; past it the server exits anyway (a job then resumes from its previous "
        "checkpoint, as after a crash).",
    )
    validation_timeout_s: float = Field(
        30.0,
        gt=0,
        le=600,
        description="Time a job's checks before it is created (its data read and tokenized, "
        "its grader built) may take; longer is refused with 422.",
    )
    serve_base_model: Path | None = Field(
        None,
        description="Base model directory the OpenAI-compatible routes load when no job "
        "backend shares its engine; None: the embedded base.",
    )
    serve_device: str = Field(
        "auto",
        min_length=1,
        max_length=32,
        description="Torch device of that base (auto, cpu, cuda, cuda:1, ...); with a job "
        "backend the pipeline's own device serves instead.",
    )
    serve_dtype: ModelDType = Field(
        "auto",
        description="That base's weights in memory (auto: the checkpoint's dtype where "
        "the device computes it; on a CPU bfloat16 only with native bfloat16).",
    )
    default_target_modules: TargetModules = Field(
        None,
        description="`lora.target_modules` of the jobs that leave it unset: leaf names of "
        "the base's linear layers or 'all-linear'; None: 'all-linear'.",
    )
    max_serving_adapters: int = Field(
        8,
        ge=1,
        le=4096,
        description="Checkpoint adapters kept loaded for inference; beyond this the least "
        "recently used idle one is unloaded.",
    )
    auth_cache_s: float = Field(
        10.0,
        ge=0,
        le=3600,
        description="Seconds an authenticated API key is remembered (no database query "
        "per request). Revocations through this server apply at once; ones made by "
        "another process on the same database within this time. 0: no cache.",
    )
    default_quotas: QuotaSpec = Field(default_factory=QuotaSpec)

    @field_validator("default_target_modules")
    @classmethod
    def _targets(cls, v: TargetModules) -> TargetModules:
        return check_target_names(v)

    def pipeline_spec(
        self,
        *,
        backend: Literal["inprocess", "ray"] = "inprocess",
        ray: RaySpec | None = None,
        max_active_tenants: int = 32,
    ) -> PipelineSpec:
        """The job backend's pipeline, sized by these settings (the base, its dtype and
        LoRA targets, the engine rows and rank, the trainer's budget, the staleness
        window), so that what a job is admitted against is what it runs on."""
        return PipelineSpec(
            base_model=str(self.serve_base_model) if self.serve_base_model else None,
            dtype=self.serve_dtype,
            default_target_modules=self.default_target_modules,
            backend=backend,
            ray=ray or RaySpec(),
            max_active_tenants=max_active_tenants,
            max_staleness=self.max_staleness,
            engine=EngineSpec(max_rank=self.max_lora_rank, max_batch_size=self.max_batch_rows),
            trainer=TrainerSpec(max_tokens_per_microbatch=self.max_tokens_per_microbatch),
        )

    @field_validator("admin_key", "metrics_token")
    @classmethod
    def _long_enough(cls, v: str | None) -> str | None:
        if v is not None and len(v) < 16:
            raise ValueError("the key must be at least 16 characters long")
        return v

    @property
    def artifact_dir(self) -> Path:
        """Checkpoints, adapters and datasets; database rows hold paths relative to it."""
        return self.data_dir / "artifacts"

    @property
    def database_url(self) -> str:
        return self.db_url or f"sqlite:///{(self.data_dir / 'marlaas.db').resolve()}"


def admin_key_from_env() -> str | None:
    """The admin key set in the environment (`MARLAAS_ADMIN_KEY`), if any."""
    return os.environ.get(ADMIN_KEY_ENV) or None


def metrics_token_from_env() -> str | None:
    """The `/metrics` token set in the environment (`MARLAAS_METRICS_TOKEN`), if any."""
    return os.environ.get(METRICS_TOKEN_ENV) or None
