"""`open_ray_backend`: a run's device and environment pool on Ray actors, placed by
resources (`PipelineSpec.ray`), behind the same device port and `EnvPool` the in-process
backend gives, so the orchestrator, the sync baseline and the service drive them
unchanged.

- the device: `ExecutorDevice` over `RayCompute` (`compute`): `EngineReplica` actors
  behind a `RayEngineClient`, a `TrainerWorker` actor behind a `RayTrainerClient`;
- the environments: `RayEnvPool` over `EnvWorker` actors;
- the driver holds the tokenizer and a weightless (meta-device) copy of the base: its
  shapes, for specs, checkpoints and PEFT files.

The base is loaded once per model actor from `run.base_model` (the same path on every
node). Only adapter tensors travel between the trainer and the replicas, as object refs.
Ray is joined on the calling thread (`connect`): Ray ties the processes it starts (its
GCS, raylet) to the thread that called `ray.init`, so the event loop's thread joins it,
and only the actors are built in a worker thread.

Shutdown order (`Backend.close`): the device closes (the executor stops, then the
compute collects the replicas' figures, fails what is in flight, kills the replicas and
the trainer), then the environment pool kills its workers. The actors are owned by this
process and die with it anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import ray
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerBase,
)

from marlaas.config.job import PipelineSpec
from marlaas.device.config import DeviceConfig
from marlaas.device.device import ExecutorDevice
from marlaas.distributed.actors import EngineReplica, TrainerWorker
from marlaas.distributed.cluster import connect, place
from marlaas.distributed.compute import RayCompute
from marlaas.distributed.engine_client import RayEngineClient
from marlaas.distributed.env_worker import EnvWorker
from marlaas.distributed.envs import RayEnvPool
from marlaas.distributed.trainer_client import RayTrainerClient
from marlaas.errors import ModelError
from marlaas.model.lora import LoRAModel
from marlaas.obs.recorder import Recorder
from marlaas.pipeline.context import Backend, PipelineOptions


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


def build_ray_backend(
    run: PipelineSpec, *, options: PipelineOptions, recorder: Recorder
) -> tuple[RayCompute, RayEnvPool, PreTrainedTokenizerBase, Path]:
    """The actors and their clients (blocking: the actors load the base). Ray must be
    joined already. Raises `ConfigError` when no node can host a role, `ModelError`
    for a bad base path."""
    spec = run.ray
    config = DeviceConfig.for_pipeline(run, torch_device=options.device)
    base_path = config.base_path.resolve()
    model, tokenizer = load_skeleton(base_path, config.engine.max_rank)
    replica_cls = place(EngineReplica, "engine", spec.engine, spec)
    trainer_cls = place(TrainerWorker, "trainer", spec.trainer, spec)
    env_cls = place(EnvWorker, "env", spec.env, spec)
    replicas = [
        replica_cls.remote(
            str(base_path),
            max_rank=config.engine.max_rank,
            adapter_slots=config.engine.adapter_slots,
            versions_kept=config.versions_kept,
            max_batch_size=config.engine.max_batch_size,
            max_prefill_tokens=config.engine.max_prefill_tokens,
            seed=config.engine.seed + i,
            device=config.torch_device,
            dtype=config.dtype,
            torch_threads=spec.torch_threads,
        )
        for i in range(spec.engine_replicas)
    ]
    workers = [env_cls.remote() for _ in range(spec.env_workers)]

    def make_trainer() -> Any:
        return trainer_cls.remote(
            str(base_path),
            max_rank=config.engine.max_rank,
            max_tokens_per_microbatch=config.trainer.max_tokens_per_microbatch,
            device=config.torch_device,
            dtype=config.dtype,
            torch_threads=spec.torch_threads,
        )

    try:
        trainer = RayTrainerClient(make_trainer, recorder)
        engine = RayEngineClient(
            replicas,
            model,
            rows_per_replica=config.engine.max_batch_size,
            versions_kept=config.versions_kept,
            request_retries=spec.request_retries,
        )
        compute = RayCompute(model, engine, trainer)
    except BaseException:
        for actor in (*replicas, *workers):  # nothing may outlive a failed build
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        raise
    envs = RayEnvPool(workers, options.env_concurrency, options.env_timeout_s, recorder)
    return compute, envs, tokenizer, base_path


async def open_ray_backend(
    run: PipelineSpec, *, options: PipelineOptions, recorder: Recorder
) -> Backend:
    """The run's backend on Ray (a `BackendOpener`; see the module docstring)."""
    connect(run.ray)
    compute, envs, tokenizer, base_path = await asyncio.to_thread(
        build_ray_backend, run, options=options, recorder=recorder
    )
    device = ExecutorDevice.start(
        compute,
        model=compute.model,
        tokenizer=tokenizer,
        base_name=str(base_path),
        versions_kept=run.versions_kept,
        recorder=recorder,
    )
    return Backend(device, envs)
