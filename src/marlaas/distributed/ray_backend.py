"""`build_ray_context`: the components of a run, served by Ray actors, behind the same
`PipelineContext` the in-process builder returns, so the orchestrator, the sync
baseline and `run_jobs` drive them unchanged.

| context field | in-process            | Ray                                              |
| ------------- | --------------------- | ------------------------------------------------ |
| `engine`      | `RolloutEngine`       | `RayEngineClient` over `EngineReplica` actors     |
| `bank`        | `AdapterBank`         | `RayBank`: registers/publishes/removes on every replica |
| `trainer`     | `GRPOTrainer`    | `RayTrainerClient` over a `TrainerWorker` actor   |
| `executor`    | `DeviceExecutor`      | `RayExecutor`                                     |
| `envs`        | `EnvPool`             | `RayEnvPool` over `EnvWorker` actors              |
| `gate`        | `RequestGate`         | the same `RequestGate`, over the engine client    |
| `model`       | the base with LoRA    | a weightless (meta-device) copy: shapes only      |

The base is loaded once per model actor from `run.base_model` (the same path on every
node); the driver loads only its config and tokenizer. Only adapter tensors travel
between the trainer and the replicas, as object refs. Every job's task family is placed
on the environment workers (`ctx.tasks`); a job submitted later must be placed with
`ctx.envs.place(family)` by whoever builds its task.

Shutdown order: the owner stops the executor, then calls `ctx.engine.shutdown()`, which
fails what is still in flight and then kills the replicas, the trainer and the
environment workers (the actors are owned by this process and die with it anyway).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import ray
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerBase,
)

from marlaas.config.job import RunSpec
from marlaas.config.ray import RaySpec
from marlaas.config.specs import LoRASpec
from marlaas.distributed.actors import EngineReplica, TrainerWorker
from marlaas.distributed.cluster import connect, place
from marlaas.distributed.engine_client import RayEngineClient
from marlaas.distributed.env_worker import EnvWorker
from marlaas.distributed.envs import RayEnvPool
from marlaas.distributed.executor import RayExecutor
from marlaas.distributed.trainer_client import RayTrainerClient
from marlaas.envs.base import TaskFamily
from marlaas.errors import ConfigError, ModelError
from marlaas.model.bank import AdapterBank
from marlaas.model.base import default_base_path
from marlaas.model.lora import AdapterTensors, LoRAModel
from marlaas.obs.recorder import NullRecorder, Recorder
from marlaas.pipeline.context import PipelineContext, PipelineOptions
from marlaas.pipeline.data import build_task
from marlaas.pipeline.scheduler import RequestGate
from marlaas.rollout.engine import RolloutEngine
from marlaas.train.grpo import GRPOTrainer


class RayBank:
    """The adapter-bank surface the pipeline and the service's inference use, kept on
    every replica: training tenants register and publish; serving adapters (`serve:*`,
    from PEFT tensors on disk) are registered and removed the same way."""

    def __init__(self, engine: RayEngineClient, versions_kept: int) -> None:
        self.engine = engine
        self.versions_kept = versions_kept

    def register(
        self,
        tenant: str,
        spec: LoRASpec,
        tensors: AdapterTensors | None = None,
        seed: int = 0,
    ) -> None:
        """Add `tenant` at version 0 on every replica: `tensors`, or a fresh PEFT-style
        init from `seed` (made here, on the CPU, from the base's shapes)."""
        if tensors is None:
            tensors = self.engine.model.init_adapter(spec, seed)
        self.engine.register(tenant, spec, tensors)

    def remove(self, tenant: str) -> None:
        """Forget `tenant` on every replica (`TenantNotFound` when it is not registered)."""
        self.engine.remove(tenant)

    def publish(self, tenant: str, version: int, tensors: AdapterTensors) -> None:
        self.engine.publish(tenant, version, tensors)

    def latest_version(self, tenant: str) -> int:
        return self.engine.latest_version(tenant)

    def tenants(self) -> list[str]:
        return self.engine.tenants()

    def __contains__(self, tenant: object) -> bool:
        return tenant in self.engine


def load_skeleton(path: Path, max_rank: int) -> tuple[LoRAModel, PreTrainedTokenizerBase]:
    """The base's architecture on the meta device (no weights) with LoRA layers, and its
    tokenizer: what the driver needs for shapes and tokens."""
    if not (path / "config.json").is_file():
        raise ModelError(
            f"{str(path)!r} is not a Hugging Face model directory (no config.json); the "
            "Ray backend loads the base from this path on every node"
        )
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        with torch.device("meta"):
            base = AutoModelForCausalLM.from_config(config)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelError(f"cannot read the base model in {str(path)!r}: {e}") from e
    base.eval()
    base.requires_grad_(False)
    return LoRAModel(base, max_rank=max_rank), tokenizer


def build_ray_context(
    run: RunSpec,
    out_dir: Path,
    options: PipelineOptions | None = None,
    *,
    ray_spec: RaySpec | None = None,
    recorder: Recorder | None = None,
    resume: bool = False,
    tasks: Mapping[str, TaskFamily] | None = None,
    max_staleness: int | None = None,
) -> PipelineContext:
    """The run's components on Ray (blocking: starts the actors, which load the base).

    Arguments are those of `runner.build_context`, plus `ray_spec` (where to connect,
    how many actors, their resources). Raises `ConfigError` when no node can host a
    role, `ModelError` for a bad base path.
    """
    options = options or PipelineOptions()
    spec = ray_spec or RaySpec()
    recorder = recorder or NullRecorder()
    out_dir = Path(out_dir)
    base_path = (Path(run.base_model) if run.base_model else default_base_path()).resolve()
    model, tokenizer = load_skeleton(base_path, run.engine.max_rank)
    if max_staleness is None:
        if not run.jobs:
            raise ConfigError("a run without jobs must give max_staleness")
        max_staleness = max(job.algorithm.max_staleness for job in run.jobs)
    versions_kept = max_staleness + 2

    connect(spec)
    replica_cls = place(EngineReplica, "engine", spec.engine, spec)
    trainer_cls = place(TrainerWorker, "trainer", spec.trainer, spec)
    env_cls = place(EnvWorker, "env", spec.env, spec)
    replicas = [
        replica_cls.remote(
            str(base_path),
            max_rank=run.engine.max_rank,
            adapter_slots=run.engine.adapter_slots,
            versions_kept=versions_kept,
            max_batch_size=run.engine.max_batch_size,
            max_prefill_tokens=options.max_prefill_tokens,
            seed=options.engine_seed + i,
            device=options.device,
            dtype=run.dtype,
            torch_threads=spec.torch_threads,
        )
        for i in range(spec.engine_replicas)
    ]
    workers = [env_cls.remote() for _ in range(spec.env_workers)]

    def make_trainer() -> Any:
        return trainer_cls.remote(
            str(base_path),
            max_rank=run.engine.max_rank,
            max_tokens_per_microbatch=run.trainer.max_tokens_per_microbatch,
            device=options.device,
            dtype=run.dtype,
            torch_threads=spec.torch_threads,
        )

    built: list[PipelineContext] = []
    try:
        trainer = RayTrainerClient(
            make_trainer, model, lambda name: built[0].checkpoint_dir(name), recorder
        )
        engine = RayEngineClient(
            replicas,
            model,
            rows_per_replica=run.engine.max_batch_size,
            versions_kept=versions_kept,
            request_retries=spec.request_retries,
        )
    except BaseException:
        for actor in (*replicas, *workers):  # nothing may outlive a failed build
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        raise
    envs = RayEnvPool(workers, options.env_concurrency, options.env_timeout_s, recorder)
    engine.on_shutdown.extend([envs.close, trainer.close])
    gate = RequestGate(cast(RolloutEngine, engine), capacity=engine.capacity)
    executor = RayExecutor(engine, trainer, gate, recorder)
    placed = dict(tasks or {})
    for job in run.jobs:
        placed[job.name] = envs.place(placed.get(job.name) or build_task(job, tokenizer))
    ctx = PipelineContext(
        run=run,
        out_dir=out_dir,
        model=model,
        tokenizer=tokenizer,
        bank=cast(AdapterBank, RayBank(engine, versions_kept)),
        engine=cast(RolloutEngine, engine),
        trainer=cast(GRPOTrainer, trainer),
        gate=gate,
        executor=executor,
        envs=envs,
        recorder=recorder,
        options=options,
        resume=resume,
        base_name=str(base_path),
        tasks=placed,
    )
    built.append(ctx)
    return ctx
