"""How long the synchronous baseline would take for a run's work, measured on a slice.

Running the whole baseline next to every async run doubles the wait, and modelling it
from the async run's own stage times is guesswork (async decode batches mix tenants, so
no tenant's generation time is observed alone). So the estimate is a measurement:

1. Run the real synchronous baseline (`SyncBaseline`: one tenant at a time; per step
   generate, then environment, then train; same engine, environments, trainer and
   hyper-parameters) on a *slice* of the work: every job cut to `slice_steps` steps,
   with its evals and checkpoints as the baseline does them.
2. From that run's recorder, per tenant: the time of each step (first rollout of the
   step to the trainer's result), of each eval, of each checkpoint, and the rest of the
   tenant's time (setup, adapter save: "fixed").
3. Extrapolate linearly per tenant to its full job,
   ``T = fixed + steps * mean(step) + evals * mean(eval) + checkpoints * mean(checkpoint)``
   with the baseline's own eval and checkpoint schedule, and sum over tenants (the
   baseline runs them one after another), plus the slice's time between tenants.

The per-step time is assumed constant over a job (completion lengths drift as a policy
learns; a longer slice averages more steps). Step times are read from spans of a
synchronous run; on an async run, where steps of one tenant overlap, they mean nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

from marlaas.config.job import JobSpec, RunSpec
from marlaas.errors import ConfigError
from marlaas.obs.memory import RunRecorder
from marlaas.obs.progress import TenantEnded, TenantStarted
from marlaas.obs.records import Span
from marlaas.pipeline.context import BackendOpener, PipelineOptions
from marlaas.pipeline.runner import RunResult, run_jobs
from marlaas.status import JobStatus


def eval_count(job: JobSpec) -> int:
    """Evals the synchronous baseline runs for `job`: before, every `eval_every`, after."""
    every = job.eval_every
    between = (job.steps - 1) // every if every > 0 else 0
    return 2 + between


def checkpoint_count(job: JobSpec) -> int:
    """Checkpoints the synchronous baseline writes for `job`: every `checkpoint_every`
    before the last step, then the final one."""
    every = job.checkpoint_every
    between = (job.steps - 1) // every if every > 0 else 0
    return 1 + between


def slice_spec(run: RunSpec, steps: int) -> RunSpec:
    """`run` with every job cut to at most `steps` steps (all else unchanged)."""
    if steps < 1:
        raise ConfigError(f"the sync slice needs at least 1 step per tenant, got {steps}")
    jobs = tuple(job.model_copy(update={"steps": min(steps, job.steps)}) for job in run.jobs)
    return run.updated(jobs=jobs)


@dataclass(frozen=True)
class TenantSample:
    """What the slice measured of one tenant, in seconds."""

    name: str
    wall_s: float
    step_s: tuple[float, ...]
    eval_s: tuple[float, ...]
    checkpoint_s: tuple[float, ...]

    @property
    def fixed_s(self) -> float:
        """The tenant's time outside steps, evals and checkpoints (setup, adapter save)."""
        measured = sum(self.step_s) + sum(self.eval_s) + sum(self.checkpoint_s)
        return max(self.wall_s - measured, 0.0)


@dataclass(frozen=True)
class SliceMeasurement:
    """A synchronous run of a slice of the work, per tenant."""

    wall_s: float
    tenants: dict[str, TenantSample]

    @property
    def between_tenants_s(self) -> float:
        """Run time outside every tenant's own window (teardown, hand-over)."""
        return max(self.wall_s - sum(t.wall_s for t in self.tenants.values()), 0.0)


@dataclass(frozen=True)
class TenantEstimate:
    """One tenant's full job under the synchronous baseline, extrapolated."""

    name: str
    steps: int
    evals: int
    checkpoints: int
    step_s: float
    eval_s: float
    checkpoint_s: float
    fixed_s: float

    @property
    def total_s(self) -> float:
        return (
            self.fixed_s
            + self.steps * self.step_s
            + self.evals * self.eval_s
            + self.checkpoints * self.checkpoint_s
        )


@dataclass(frozen=True)
class SyncEstimate:
    """The estimated synchronous time of a run's work and how it was obtained."""

    slice_steps: int
    slice_wall_s: float
    between_tenants_s: float
    tenants: dict[str, TenantEstimate]
    #: Jobs the slice could not measure (failed there); not in `total_s`.
    missing: tuple[str, ...] = ()

    @property
    def total_s(self) -> float:
        return self.between_tenants_s + sum(t.total_s for t in self.tenants.values())

    def explain(self) -> str:
        """How the figure was obtained, in words, for under a results table."""
        n = len(self.tenants)
        steps = sum(t.steps for t in self.tenants.values())
        text = (
            f"measured, then extrapolated. The synchronous loop (one tenant at a time; each "
            f"step generate, then environment, then train; same engine, environments, "
            f"trainer and hyper-parameters) ran {self.slice_steps} step(s) of each of the "
            f"{n} tenants, with their evals and checkpoints, in {self.slice_wall_s:.1f} s. "
            f"Per tenant, time = setup + steps x its measured step time + evals x its "
            f"measured eval time + checkpoints x its measured checkpoint time; the baseline "
            f"runs tenants one after another, so the {n} tenants' times ({steps} steps in "
            f"all) add up to {self.total_s:.1f} s."
        )
        if self.missing:
            text += f" Not included (they failed in the slice): {', '.join(self.missing)}."
        return text

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["total_s"] = self.total_s
        for name, tenant in self.tenants.items():
            out["tenants"][name]["total_s"] = tenant.total_s
        out["method"] = self.explain()
        return out


def step_times(rollouts: Iterable[Span], trains: Iterable[Span]) -> tuple[float, ...]:
    """Per step of one tenant of a synchronous run: from the first rollout that started
    after the previous step's train span ended to the end of the step's train span."""
    rollouts = sorted(rollouts, key=lambda s: s.start)
    times = []
    boundary = float("-inf")
    for train in sorted(trains, key=lambda s: s.start):
        starts = [r.start for r in rollouts if boundary <= r.start and r.end <= train.end]
        times.append(train.end - min(starts, default=train.start))
        boundary = train.end
    return tuple(times)


def measure_slice(recorder: RunRecorder, wall_s: float) -> SliceMeasurement:
    """Per-tenant times of a finished synchronous run from its recorder; tenants that did
    not finish (no `TenantEnded` record with status done) are left out."""
    tenants: dict[str, TenantSample] = {}
    for name in recorder.tenants():
        started = recorder.progress_records(TenantStarted, tenant=name)
        ended = recorder.progress_records(TenantEnded, tenant=name)
        done = [e for e in ended if e.record.status is JobStatus.DONE]
        if not started or not done:
            continue
        tenants[name] = TenantSample(
            name=name,
            wall_s=done[-1].time - started[0].time,
            step_s=step_times(
                recorder.spans("rollout", tenant=name), recorder.spans("train", tenant=name)
            ),
            eval_s=tuple(s.duration for s in recorder.spans("eval", tenant=name)),
            checkpoint_s=tuple(s.duration for s in recorder.spans("checkpoint", tenant=name)),
        )
    return SliceMeasurement(wall_s=wall_s, tenants=tenants)


def _mean(values: Sequence[float]) -> float:
    return fmean(values) if values else 0.0


def extrapolate(
    measurement: SliceMeasurement, jobs: Sequence[JobSpec], slice_steps: int
) -> SyncEstimate:
    """The synchronous time of `jobs` in full from a slice's measurement (see the module
    docstring for the formula)."""
    tenants: dict[str, TenantEstimate] = {}
    missing: list[str] = []
    for job in jobs:
        sample = measurement.tenants.get(job.name)
        if sample is None or not sample.step_s:
            missing.append(job.name)
            continue
        tenants[job.name] = TenantEstimate(
            name=job.name,
            steps=job.steps,
            evals=eval_count(job) if sample.eval_s else 0,
            checkpoints=checkpoint_count(job) if sample.checkpoint_s else 0,
            step_s=_mean(sample.step_s),
            eval_s=_mean(sample.eval_s),
            checkpoint_s=_mean(sample.checkpoint_s),
            fixed_s=sample.fixed_s,
        )
    return SyncEstimate(
        slice_steps=slice_steps,
        slice_wall_s=measurement.wall_s,
        between_tenants_s=measurement.between_tenants_s,
        tenants=tenants,
        missing=tuple(missing),
    )


async def estimate_sync_time(
    run: RunSpec,
    out_dir: Path,
    *,
    backend: BackendOpener,
    slice_steps: int = 1,
    recorder: RunRecorder | None = None,
    options: PipelineOptions | None = None,
) -> tuple[SyncEstimate, RunResult]:
    """Run the synchronous baseline on a slice of `run` (outputs under `out_dir`, on the
    backend `backend` opens) and extrapolate to all of it. `recorder` (default: in memory only) receives the slice's
    records, e.g. for a live view. Returns the estimate and the slice's own result."""
    recorder = recorder if recorder is not None else RunRecorder()
    spec = slice_spec(run, slice_steps)
    result = await run_jobs(
        spec, out_dir, backend=backend, mode="sync", recorder=recorder, options=options
    )
    measurement = measure_slice(recorder, result.wall_s)
    return extrapolate(measurement, run.jobs, slice_steps), result
