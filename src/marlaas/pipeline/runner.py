"""Run a `RunSpec`: build the shared components once, run every job in async or sync
mode, write the outputs, return per-tenant results.

Outputs under `out_dir`:
- `run.json`: the resolved RunSpec (every default filled in);
- `tenants/<job>/checkpoints/ckpt-<version>/`: atomic tenant checkpoints;
- `tenants/<job>/adapter/`: the final adapter of each finished job, in PEFT format;
- `result.json`: the `RunResult` (statuses, evals, device busy fraction, tokens,
  staleness), written atomically at the end.

Shutdown order (end of `run_jobs`, normal or not): the orchestrator (or baseline) has
cancelled and awaited every tenant task -> stop the device executor (it finishes the
step in progress; queued work fails with `ExecutorClosed`) -> shut the engine down
(requests still queued fail with `EngineClosed`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from marlaas.config.job import RunSpec
from marlaas.envs.base import TaskFamily
from marlaas.fileio import atomic_write_json
from marlaas.model.bank import AdapterBank
from marlaas.model.base import default_base_path, load_base
from marlaas.model.lora import LoRAModel
from marlaas.obs.recorder import NullRecorder, Recorder
from marlaas.pipeline.baseline import SyncBaseline
from marlaas.pipeline.context import PipelineContext, PipelineOptions
from marlaas.pipeline.envpool import EnvPool
from marlaas.pipeline.executor import DeviceExecutor
from marlaas.pipeline.orchestrator import Orchestrator
from marlaas.pipeline.scheduler import RequestGate
from marlaas.pipeline.tenant import TenantState
from marlaas.rollout.engine import RolloutEngine
from marlaas.train.grpo import GRPOTrainer

Mode = Literal["async", "sync"]


@dataclass(frozen=True)
class TenantResult:
    """How one job ended. Eval accuracies are keyed by adapter version (= step)."""

    name: str
    status: str
    priority: float
    steps: int
    steps_done: int
    eval_before: float | None
    eval_after: float | None
    eval_accuracy: dict[int, float]
    failure_reason: str | None
    staleness_max: int
    staleness_mean: float
    staleness_violations: int
    groups_dropped_stale: int
    episode_retries: int
    tokens_generated: int
    tokens_trained: int

    @classmethod
    def from_state(cls, state: TenantState, tokens_generated: int) -> TenantResult:
        evals = dict(sorted(state.stats.eval_accuracy.items()))
        return cls(
            name=state.name,
            status=str(state.status),
            priority=state.job.priority,
            steps=state.steps,
            steps_done=state.version,
            eval_before=evals[min(evals)] if evals else None,
            eval_after=evals.get(state.version),
            eval_accuracy=evals,
            failure_reason=state.reason if state.status == "failed" else None,
            staleness_max=state.stats.staleness_max,
            staleness_mean=state.stats.staleness_mean,
            staleness_violations=state.stats.staleness_violations,
            groups_dropped_stale=state.stats.groups_dropped_stale,
            episode_retries=state.stats.episode_retries,
            tokens_generated=tokens_generated,
            tokens_trained=state.stats.tokens_trained,
        )


@dataclass(frozen=True)
class RunResult:
    """A run's outcome and its headline figures (device figures from the executor)."""

    mode: Mode
    tenants: dict[str, TenantResult]
    wall_s: float
    device_busy_fraction: float
    device_busy_s: float
    decode_busy_s: float
    train_busy_s: float
    decode_steps: int
    mean_decode_batch: float
    train_steps: int
    max_tenants_per_train_step: int
    tokens_generated: int
    tokens_trained: int
    staleness_max: int
    staleness_violations: int
    out_dir: str
    #: Prompt tokens the engine ran, and those whose prefill it shared (`EngineStats`).
    prefill_tokens: int = 0
    shared_prefill_tokens: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def prepare_backend(run: RunSpec) -> None:
    """What must happen on the calling thread before `build_context` runs in a worker
    thread: Ray ties the processes it starts (its GCS, raylet) to the *thread* that
    called `ray.init`, so joining Ray from a short-lived worker thread would kill the
    cluster when that thread ends. Call it from the thread that owns the run (the event
    loop's); a no-op for the in-process backend."""
    if run.backend == "ray":
        from marlaas.distributed import connect

        connect(run.ray)


def build_context(
    run: RunSpec,
    out_dir: Path,
    *,
    recorder: Recorder | None = None,
    options: PipelineOptions | None = None,
    resume: bool = False,
    tasks: Mapping[str, TaskFamily] | None = None,
    max_staleness: int | None = None,
) -> PipelineContext:
    """The run's shared components (blocking: loads the base). `max_staleness` bounds
    the jobs' `algorithm.max_staleness` (it sizes the adapter bank's version window);
    None: the largest among `run.jobs` (a long-lived pipeline, whose jobs come later,
    gives it)."""
    if run.backend == "ray":  # the optional extra: imported only when asked for
        from marlaas.distributed import build_ray_context

        return build_ray_context(
            run,
            out_dir,
            options,
            ray_spec=run.ray,
            recorder=recorder,
            resume=resume,
            tasks=tasks,
            max_staleness=max_staleness,
        )
    options = options or PipelineOptions()
    recorder = recorder or NullRecorder()
    base_path = Path(run.base_model) if run.base_model else default_base_path()
    base, tokenizer = load_base(base_path, dtype=run.dtype, device=resolve_device(options.device))
    model = LoRAModel(base, max_rank=run.engine.max_rank)
    if max_staleness is None:
        max_staleness = max(job.algorithm.max_staleness for job in run.jobs)
    versions_kept = max_staleness + 2
    bank = AdapterBank(model, num_slots=run.engine.adapter_slots, versions_kept=versions_kept)
    engine = RolloutEngine(
        model,
        bank,
        tokenizer,
        max_batch_size=run.engine.max_batch_size,
        max_prefill_tokens=options.max_prefill_tokens,
        background=False,
        seed=options.engine_seed,
    )
    trainer = GRPOTrainer(model, max_tokens_per_microbatch=run.trainer.max_tokens_per_microbatch)
    gate = RequestGate(engine, capacity=run.engine.max_batch_size)
    executor = DeviceExecutor(engine, trainer, gate, recorder)
    envs = EnvPool(options.env_concurrency, options.env_timeout_s, recorder)
    return PipelineContext(
        run=run,
        out_dir=out_dir,
        model=model,
        tokenizer=tokenizer,
        bank=bank,
        engine=engine,
        trainer=trainer,
        gate=gate,
        executor=executor,
        envs=envs,
        recorder=recorder,
        options=options,
        resume=resume,
        base_name=str(base_path),
        tasks=dict(tasks or {}),
    )


async def run_jobs(
    run: RunSpec,
    out_dir: Path,
    *,
    mode: Mode = "async",
    recorder: Recorder | None = None,
    resume: bool = False,
    options: PipelineOptions | None = None,
    tasks: Mapping[str, TaskFamily] | None = None,
) -> RunResult:
    """Run every job of `run` to the end (see the module docstring for the outputs).

    `mode="async"` is the event-driven multi-tenant pipeline, `"sync"` the conventional
    baseline. `resume=True` restores each job from its latest checkpoint (adapter,
    optimizer, step, RNG, data cursor) and continues to its `steps`. `tasks` replaces the
    task of the named jobs with a custom `TaskFamily`. A job's failure is reported in its
    `TenantResult`; only a failure of the shared device executor raises.
    """
    if mode not in ("async", "sync"):
        raise ValueError(f"mode must be 'async' or 'sync', got {mode!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "run.json", run.model_dump(mode="json"), sort_keys=True)
    prepare_backend(run)
    ctx = await asyncio.to_thread(
        build_context,
        run,
        out_dir,
        recorder=recorder,
        options=options,
        resume=resume,
        tasks=tasks,
    )
    ctx.recorder.event("run_started", mode=mode, jobs=len(run.jobs), resume=resume)
    t0 = time.perf_counter()
    ctx.executor.start()
    try:
        runner = Orchestrator(ctx, run.jobs) if mode == "async" else SyncBaseline(ctx, run.jobs)
        states = await runner.run()
    finally:
        await ctx.executor.stop()
        await asyncio.to_thread(ctx.engine.shutdown)
    wall = time.perf_counter() - t0
    result = _summarize(ctx, mode, states, wall)
    atomic_write_json(out_dir / "result.json", result.to_json(), sort_keys=True)
    ctx.recorder.event(
        "run_finished", mode=mode, wall_s=wall, busy_fraction=result.device_busy_fraction
    )
    return result


def _summarize(
    ctx: PipelineContext, mode: Mode, states: Mapping[str, TenantState], wall: float
) -> RunResult:
    ex = ctx.executor
    tenants = {
        name: TenantResult.from_state(state, ctx.gate.tokens.get(name, 0))
        for name, state in states.items()
    }
    results = tenants.values()
    prefill_tokens, shared_prefill_tokens = ex.prompt_tokens()
    return RunResult(
        mode=mode,
        tenants=tenants,
        wall_s=wall,
        device_busy_fraction=ex.busy_fraction,
        device_busy_s=ex.busy_s,
        decode_busy_s=ex.busy_decode_s,
        train_busy_s=ex.busy_train_s,
        decode_steps=ex.decode_steps,
        mean_decode_batch=ex.mean_decode_batch,
        train_steps=ex.train_steps,
        max_tenants_per_train_step=ex.max_lanes,
        tokens_generated=sum(r.tokens_generated for r in results),
        tokens_trained=sum(r.tokens_trained for r in results),
        staleness_max=max((r.staleness_max for r in results), default=0),
        staleness_violations=sum(r.staleness_violations for r in results),
        out_dir=str(ctx.out_dir),
        prefill_tokens=prefill_tokens,
        shared_prefill_tokens=shared_prefill_tokens,
    )
