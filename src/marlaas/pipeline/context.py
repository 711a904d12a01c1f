"""What every pipeline mode shares: the pipeline's own knobs (`PipelineOptions`) and the
run's components (`PipelineContext`), built once per run by `marlaas.pipeline.runner`.

The context holds the shared base, engine, trainer and adapter bank; the request gate
(fair share) in front of the engine; the device executor (the only thread that runs
model compute); the environment pool; the recorder; and where outputs go. It owns no
per-tenant state: that lives in `TenantState` / `TenantRuntime`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import Field
from transformers import PreTrainedTokenizerBase

from marlaas.config.job import JobSpec, RunSpec
from marlaas.config.specs import Spec
from marlaas.envs.base import TaskFamily
from marlaas.model.bank import AdapterBank
from marlaas.model.chat import require_template
from marlaas.model.lora import LoRAModel
from marlaas.obs.recorder import Recorder
from marlaas.pipeline.envpool import EnvPool
from marlaas.pipeline.executor import DeviceExecutor
from marlaas.pipeline.scheduler import RequestGate
from marlaas.rollout.engine import RolloutEngine
from marlaas.train.grpo import GRPOTrainer


class PipelineOptions(Spec):
    """Knobs of the pipeline itself (not of any tenant's job)."""

    device: str = Field(
        default="auto",
        description="Torch device of the base: 'auto' (cuda if available), 'cpu', ...",
    )
    env_concurrency: int = Field(
        default=256,
        ge=1,
        description="Environment calls (tools, graders) running at once, all tenants.",
    )
    env_timeout_s: float = Field(
        default=120.0, gt=0, description="Limit of one environment call; past it the call fails."
    )
    episode_retries: int = Field(
        default=2,
        ge=0,
        description="Retries of an episode whose environment failed, before its tenant is failed.",
    )
    keep_checkpoints: int = Field(default=3, ge=1, description="Checkpoints kept per tenant.")
    max_prefill_tokens: int = Field(
        default=4096, ge=1, description="Prompt tokens the engine admits per iteration."
    )
    engine_seed: int = Field(default=0, description="Seed of the engine's own sampling generator.")


@dataclass(eq=False)
class PipelineContext:
    """The run's shared components (see the module docstring)."""

    run: RunSpec
    out_dir: Path
    model: LoRAModel
    tokenizer: PreTrainedTokenizerBase
    bank: AdapterBank
    engine: RolloutEngine
    trainer: GRPOTrainer
    gate: RequestGate
    executor: DeviceExecutor
    envs: EnvPool
    recorder: Recorder
    options: PipelineOptions
    resume: bool = False
    base_name: str | None = None
    #: Task families that replace a job's own task, by job name (custom environments).
    tasks: Mapping[str, TaskFamily] = field(default_factory=dict)

    def resolve_job(self, job: JobSpec) -> JobSpec:
        """`job` with its LoRA targets named for this base (`lora.target_modules` unset:
        the run's `default_target_modules`); `ConfigError` when the base cannot adapt
        them, or when the job asks for a chat format and the base has no chat template.
        Jobs are resolved once, when submitted, so checkpoints and exported adapters
        record explicit names."""
        if job.task.format == "chat":
            require_template(self.tokenizer, f"job {job.name!r}: task.format chat")
        lora = self.model.resolve(job.lora, default=self.run.default_target_modules)
        return job if lora is job.lora else job.model_copy(update={"lora": lora})

    def tenant_dir(self, name: str) -> Path:
        return self.out_dir / "tenants" / name

    def checkpoint_dir(self, name: str) -> Path:
        return self.tenant_dir(name) / "checkpoints"

    def adapter_dir(self, name: str) -> Path:
        return self.tenant_dir(name) / "adapter"
