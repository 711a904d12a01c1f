"""Run a `RunSpec`: open its backend once (the caller says how: a `BackendOpener`), run
every job in async or sync mode, write the outputs, return per-tenant results.

Outputs under `out_dir`:
- `run.json`: the resolved RunSpec (every default filled in);
- `tenants/<job>/checkpoints/ckpt-<version>/`: atomic tenant checkpoints;
- `tenants/<job>/adapter/`: the final adapter of each finished job, in PEFT format;
- `result.json`: the `RunResult` (statuses, evals, device busy fraction, tokens,
  staleness), written atomically at the end.

Shutdown order (end of `run_jobs`, normal or not): the orchestrator (or baseline) has
cancelled and awaited every tenant task -> close the backend (the device finishes the
turn in progress; queued calls fail with `ExecutorClosed`, requests still held with
`EngineClosed`; then the environment pool) -> read the device's final figures.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from marlaas.config.job import RunSpec
from marlaas.device.records import DeviceFigures
from marlaas.envs.base import TaskFamily
from marlaas.errors import ConfigError
from marlaas.fileio import atomic_write_json
from marlaas.obs.recorder import NullRecorder, Recorder
from marlaas.pipeline.baseline import SyncBaseline
from marlaas.pipeline.context import BackendOpener, PipelineContext, PipelineOptions
from marlaas.pipeline.judges import JudgeFactory, base_judge
from marlaas.pipeline.orchestrator import Orchestrator
from marlaas.pipeline.tenant import TenantState

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
    #: Held-out episodes an eval asks (`JobSpec.eval_episodes`): an accuracy resolves
    #: no finer than one of them.
    eval_episodes: int
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
            eval_episodes=state.job.eval_episodes,
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


async def run_jobs(
    run: RunSpec,
    out_dir: Path,
    *,
    backend: BackendOpener,
    mode: Mode = "async",
    recorder: Recorder | None = None,
    restore: bool = False,
    options: PipelineOptions | None = None,
    tasks: Mapping[str, TaskFamily] | None = None,
    judges: JudgeFactory | None = base_judge,
) -> RunResult:
    """Run every job of `run` to the end (see the module docstring for the outputs).

    `backend` opens where the stages live (`marlaas.backends.open_backend` reads
    `run.backend`). `mode="async"` is the event-driven multi-tenant pipeline, `"sync"`
    the conventional baseline. `restore=True` restores each job from its latest
    checkpoint (adapter, optimizer, step, data cursor) and continues to its
    `steps`. `tasks` replaces the task of the named jobs with a custom `TaskFamily`.
    `judges` answers the jobs' model graders (default: the run's base, `base_judge`). A
    job's failure is reported in its `TenantResult`; only a failure of the shared device
    raises.
    """
    if mode not in ("async", "sync"):
        raise ValueError(f"mode must be 'async' or 'sync', got {mode!r}")
    supervised = [j.name for j in run.jobs if j.supervised]
    if mode == "sync" and supervised:
        raise ConfigError(
            f"jobs {', '.join(supervised)} are supervised (algorithm.type sft), and the sync "
            "baseline runs RL jobs only; run them in async mode"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "run.json", run.model_dump(mode="json"), sort_keys=True)
    ctx = await PipelineContext.open(
        run,
        out_dir,
        backend=backend,
        recorder=recorder or NullRecorder(),
        options=options,
        restore=restore,
        tasks=tasks,
        judges=judges,
    )
    ctx.recorder.event("run_started", mode=mode, jobs=len(run.jobs), restore=restore)
    t0 = time.perf_counter()
    try:
        runner = Orchestrator(ctx, run.jobs) if mode == "async" else SyncBaseline(ctx, run.jobs)
        states = await runner.run()
    finally:
        await ctx.backend.close()
    wall = time.perf_counter() - t0
    result = _summarize(ctx.device.figures(), str(out_dir), mode, states, wall)
    atomic_write_json(out_dir / "result.json", result.to_json(), sort_keys=True)
    ctx.recorder.event(
        "run_finished", mode=mode, wall_s=wall, busy_fraction=result.device_busy_fraction
    )
    return result


def _summarize(
    figures: DeviceFigures,
    out_dir: str,
    mode: Mode,
    states: Mapping[str, TenantState],
    wall: float,
) -> RunResult:
    tenants = {
        name: TenantResult.from_state(state, figures.tokens_by_tenant.get(name, 0))
        for name, state in states.items()
    }
    results = tenants.values()
    return RunResult(
        mode=mode,
        tenants=tenants,
        wall_s=wall,
        device_busy_fraction=figures.busy_fraction,
        device_busy_s=figures.busy_s,
        decode_busy_s=figures.busy_decode_s,
        train_busy_s=figures.busy_train_s,
        decode_steps=figures.decode_steps,
        mean_decode_batch=figures.mean_decode_batch,
        train_steps=figures.train_passes,
        max_tenants_per_train_step=figures.max_pass_tenants,
        tokens_generated=sum(r.tokens_generated for r in results),
        tokens_trained=sum(r.tokens_trained for r in results),
        staleness_max=max((r.staleness_max for r in results), default=0),
        staleness_violations=sum(r.staleness_violations for r in results),
        out_dir=out_dir,
        prefill_tokens=figures.prefill_tokens,
        shared_prefill_tokens=figures.shared_prefill_tokens,
    )
