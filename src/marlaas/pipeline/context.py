"""What every pipeline mode shares: the pipeline's own knobs (`PipelineOptions`), where
its stages live (`Backend`: the device behind its port and the environment pool), and
the run's components (`PipelineContext`), built once per run.

The backend is chosen above the pipeline: `PipelineContext.open` (so `run_jobs` and
`PipelineRuntime.start`) takes a `BackendOpener` (`marlaas.backends.open_backend` reads
the run's `backend` and opens the in-process or the Ray one); the pipeline only ever
sees the port. Likewise the judges of model graders (`marlaas.pipeline.judges`): the
owner gives a `JudgeFactory`, or none, and a job whose grader calls a model is then
refused when it is submitted. The context owns no per-tenant state: that lives in
`TenantState` / `TenantRuntime`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pydantic import Field, model_validator

from marlaas.config.job import JobSpec, PipelineSpec
from marlaas.config.specs import Spec
from marlaas.device.port import DevicePort
from marlaas.envs.base import TaskFamily
from marlaas.envs.openai_graders import Judge
from marlaas.errors import ConfigError
from marlaas.model.chat import require_template
from marlaas.obs.recorder import Recorder
from marlaas.pipeline.envpool import EnvPool
from marlaas.pipeline.judges import JudgeFactory, job_judges

#: Engine settings that moved from `PipelineOptions` to `EngineSpec`, and where they are.
_MOVED = {"max_prefill_tokens": "engine.max_prefill_tokens", "engine_seed": "engine.seed"}


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

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        if isinstance(data, dict):
            moved = [f"{old} is now {new}" for old, new in _MOVED.items() if old in data]
            if moved:
                raise ValueError(
                    f"{'; '.join(moved)} of the pipeline's spec (`PipelineSpec` / RunSpec, "
                    "the `engine:` section of a JOBS.yaml); set it there"
                )
        return data


@dataclass(frozen=True, eq=False)
class Backend:
    """Where a run's stages live: the device behind its port, and the environment pool
    (its workers in this process, or remote). `close` releases both, device first."""

    device: DevicePort
    envs: EnvPool

    async def close(self) -> None:
        try:
            await self.device.close()
        finally:
            await asyncio.to_thread(self.envs.close)


class BackendOpener(Protocol):
    """Opens a ready `Backend` for a pipeline built from `spec` (blocking work off the
    loop); the sampler keeps `spec.versions_kept` versions per tenant."""

    async def __call__(
        self, spec: PipelineSpec, *, options: PipelineOptions, recorder: Recorder
    ) -> Backend: ...


@dataclass(eq=False)
class PipelineContext:
    """The run's shared components (see the module docstring)."""

    #: What the pipeline was built from (a `RunSpec` for `run_jobs`).
    run: PipelineSpec
    out_dir: Path
    backend: Backend
    recorder: Recorder
    options: PipelineOptions
    #: Whether a tenant restores from its latest checkpoint when it has one.
    restore: bool = False
    #: Task families that replace a job's own task, by job name (custom environments).
    tasks: Mapping[str, TaskFamily] = field(default_factory=dict)
    #: Who judges the jobs' model graders; None: a job whose grader calls a model is refused.
    judges: JudgeFactory | None = None

    @property
    def device(self) -> DevicePort:
        return self.backend.device

    @property
    def envs(self) -> EnvPool:
        return self.backend.envs

    @classmethod
    async def open(
        cls,
        run: PipelineSpec,
        out_dir: Path,
        *,
        backend: BackendOpener,
        recorder: Recorder,
        options: PipelineOptions | None = None,
        restore: bool = False,
        tasks: Mapping[str, TaskFamily] | None = None,
        judges: JudgeFactory | None = None,
    ) -> PipelineContext:
        """The run's components on a backend `backend` opens. Close it with
        `ctx.backend.close()`."""
        options = options or PipelineOptions()
        opened = await backend(run, options=options, recorder=recorder)
        if opened.device.versions_kept < run.versions_kept:
            await opened.close()
            raise ConfigError(
                f"the backend's device keeps {opened.device.versions_kept} versions per "
                f"tenant, the spec needs {run.versions_kept} (`versions_kept`); build the "
                "device with `DeviceConfig.for_pipeline(spec)`"
            )
        return cls(
            run=run,
            out_dir=Path(out_dir),
            backend=opened,
            recorder=recorder,
            options=options,
            restore=restore,
            tasks=dict(tasks or {}),
            judges=judges,
        )

    def resolve_job(self, job: JobSpec) -> JobSpec:
        """`job` with its LoRA targets named for this base (`lora.target_modules` unset:
        the run's `default_target_modules`); `ConfigError` when the base cannot adapt
        them, or when the job asks for a chat format and the base has no chat template.
        Jobs are resolved once, when submitted, so checkpoints and exported adapters
        record explicit names."""
        if job.task.format == "chat":
            require_template(self.device.tokenizer, f"job {job.name!r}: task.format chat")
        self.judge_for(job)  # a job that cannot be judged is refused here, before it starts
        lora = self.device.model.resolve(job.lora, default=self.run.default_target_modules)
        return job if lora is job.lora else job.model_copy(update={"lora": lora})

    def judge_for(self, job: JobSpec) -> Judge | None:
        """The judge of the job's model graders (None when it has none, or its task is
        replaced by a custom one); `ConfigError` naming the field when nobody can judge
        them."""
        called = job_judges(job)
        if not called or job.name in self.tasks:
            return None
        if self.judges is None:
            where, model = called[0]
            raise ConfigError(
                f"job {job.name!r}: {where} calls the judge model {model!r}, and this "
                "pipeline was started without judges; run it with a judge factory "
                "(`marlaas run` and `marlaas serve` give one), or grade without "
                "score_model / label_model"
            )
        if not self.envs.in_process:
            where, model = called[0]
            raise ConfigError(
                f"job {job.name!r}: {where} calls the judge model {model!r}, and this "
                "backend grades on remote environment workers, which cannot call a judge "
                "yet; run the job on the in-process backend, or grade without "
                "score_model / label_model"
            )
        return self.judges(self.device, job)

    def tenant_dir(self, name: str) -> Path:
        return self.out_dir / "tenants" / name

    def checkpoint_dir(self, name: str) -> Path:
        return self.tenant_dir(name) / "checkpoints"

    def adapter_dir(self, name: str) -> Path:
        return self.tenant_dir(name) / "adapter"
