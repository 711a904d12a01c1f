"""The service's job backend: the long-lived pipeline (`PipelineRuntime`) in this process.

Ids and files:
- A job runs in the pipeline as the tenant named by its database id (job names are
  unique only within one tenant; ids are unique and are valid tenant names).
- Its files lie under `<artifact_dir>/pipeline/tenants/<job id>/`: `checkpoints/ckpt-<step>/`
  (atomic: adapter, optimizer, data cursor) and, once done, `adapter/`. A
  checkpoint's database row points at the PEFT adapter directory inside it
  (`ckpt-<step>/adapter`). The pipeline keeps every checkpoint, since the database
  refers to each: a job's `keep_checkpoints` is applied by the `JobReporter` (rows
  first, then folders), and deleting the job (`DELETE /v1/jobs/{id}`) removes the
  whole folder (`deletion`).

Reports (through the `JobReporter`, in the order things happened, by one worker task):
running when the pipeline admits the job (and when it unpauses it), every step's metrics,
every eval (`eval_accuracy` at its adapter version), every checkpoint once per step,
done or failed at the end. A tenant's cancel, and the pipeline's own stop at shutdown,
report nothing: the database already says cancelled, or keeps the job active so that
the next start restores it.

Crash recovery: at startup every job that the database says is queued, running or
paused is submitted again with `restore=True`, so it continues from its latest checkpoint
on disk (paused ones stay paused). Checkpoints that reached the disk but not the
database (a crash between the two) are reported first, then the step it is restored at
(`JobReporter.restored`). Steps after the last checkpoint are trained again, and
reported again with their new metrics. A job that cannot start again (its stored spec
no longer validates, its dataset is gone, its spec is beyond this server's sizes) is
reported failed with the reason, never retried; the server serves regardless.

Shutdown (`close`): the pipeline closes with `checkpoint=True` (every running job writes
a checkpoint of its current step first), then the reports still queued are written.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select

from marlaas.backends import open_backend
from marlaas.config.job import JobSpec, PipelineSpec
from marlaas.errors import MarlaasError
from marlaas.model.base import default_base_path
from marlaas.obs.progress import (
    CheckpointWritten,
    EvalDone,
    StepDone,
    TenantEnded,
    TenantRestored,
    TenantStarted,
    TenantUnpaused,
)
from marlaas.pipeline.context import PipelineOptions
from marlaas.pipeline.judges import JudgeFactory
from marlaas.pipeline.lifecycle import Reported, reported
from marlaas.pipeline.runtime import PipelineRuntime, RuntimeFailed, RuntimeProgress
from marlaas.pipeline.tenant import PipelineError, describe_failure
from marlaas.service import datasets
from marlaas.service.backend import BackendFactory
from marlaas.service.db import Database
from marlaas.service.inference import DeviceProvider
from marlaas.service.lifecycle import ACTIVE, JobStatus
from marlaas.service.metrics import PipelineFigures
from marlaas.service.models import Checkpoint, Job, Metric
from marlaas.service.reporter import JobReporter
from marlaas.service.tinker.hub import SharedDevice
from marlaas.service.usage import BusyBin
from marlaas.train.checkpoint import ADAPTER_DIR, list_checkpoints

log = logging.getLogger(__name__)

#: Subdirectory of the artifact directory that holds the pipeline's outputs.
PIPELINE_DIR = "pipeline"
#: Checkpoints the pipeline keeps per job: all of them (the database refers to each;
#: the reporter removes those beyond a job's `keep_checkpoints`).
KEEP_ALL = 2**31
_CKPT = re.compile(r"^ckpt-(\d+)$")

_Report = Callable[[], Awaitable[Any]]


@dataclass
class _Job:
    """What the backend remembers of a job it runs."""

    checkpoints: set[int] = field(default_factory=set)
    #: The database already says running (a recovered running job): no report needed.
    running: bool = False
    ended: JobStatus | None = None
    reason: str | None = None


@dataclass(frozen=True)
class _Stored:
    """An active job as the database has it, for recovery."""

    job_id: str
    status: JobStatus
    spec: JobSpec | None
    error: str | None
    checkpoints: frozenset[int]
    #: The steps whose figures the database has.
    stepped: frozenset[int]


class PipelineBackend:
    """`JobBackend` over a `PipelineRuntime` (see the module docstring).

    Built by the app's factory on the server's event loop; it loads the base and
    recovers the database's active jobs in a task of its own, so the server answers at
    once; calls that need the pipeline wait for that task (and raise its error).
    """

    def __init__(
        self,
        reporter: JobReporter,
        db: Database,
        *,
        spec: PipelineSpec | None = None,
        options: PipelineOptions | None = None,
        recover: bool = True,
        judges: JudgeFactory | None = None,
    ) -> None:
        self._reporter = reporter
        self._judges = judges  # the jobs' model graders (`service.judges.ServiceJudges`)
        self._db = db
        self._jobs: dict[str, _Job] = {}
        self._closing = False
        self._reports: asyncio.Queue[_Report | None] = asyncio.Queue()
        self.out_dir = reporter.artifact_dir / PIPELINE_DIR
        self._base_model = (spec or PipelineSpec()).base_model
        options = (options or PipelineOptions()).model_copy(update={"keep_checkpoints": KEEP_ALL})
        self._worker = asyncio.create_task(self._write_reports(), name="job-reports")
        self._ready = asyncio.create_task(
            self._start(spec or PipelineSpec(), options, recover), name="pipeline-start"
        )
        self._ready.add_done_callback(_log_start_failure)

    @classmethod
    def factory(
        cls,
        db: Database,
        *,
        spec: PipelineSpec | None = None,
        options: PipelineOptions | None = None,
        recover: bool = True,
        judges: JudgeFactory | None = None,
    ) -> BackendFactory:
        """The app's `BackendFactory` for this backend over the service's database;
        `judges` answers the jobs' model graders (None: such jobs fail to start)."""

        def make(reporter: JobReporter) -> PipelineBackend:
            return cls(reporter, db, spec=spec, options=options, recover=recover, judges=judges)

        return make

    async def ready(self) -> PipelineRuntime:
        """The running pipeline, once the base is loaded and recovery has run."""
        return await asyncio.shield(self._ready)

    def _runtime_if_ready(self) -> PipelineRuntime | None:
        ready = self._ready
        if not ready.done() or ready.cancelled() or ready.exception() is not None:
            return None
        return ready.result()

    # -- what the service reads from the pipeline ------------------------------------

    def start_failure(self) -> BaseException | None:
        """Why the pipeline did not start (None while it starts, or once it runs); the
        OpenAI endpoints answer 503 with it instead of serving another model."""
        ready = self._ready
        if not ready.done() or ready.cancelled():
            return None
        return ready.exception()

    def inference_provider(self) -> DeviceProvider | None:
        """The OpenAI endpoints serve from the pipeline's device (one base per process);
        their requests go through the same gate as rollouts, as interactive requests
        (admitted ahead of training rows, see `marlaas.device.gate.RequestGate`)."""
        runtime = self._runtime_if_ready()
        if runtime is None:
            return None
        return DeviceProvider(runtime.ctx.device)

    async def shared_device(self) -> SharedDevice | None:
        """The pipeline's device for the Tinker-compatible API (`service.tinker`), once
        the pipeline runs: Tinker runs and jobs share its passes and batches."""
        try:
            runtime = await self.ready()
        except Exception:  # it never started; its error is in the log
            return None
        base = Path(self._base_model) if self._base_model else default_base_path()
        return SharedDevice(runtime.ctx.device, str(base.resolve()))

    def device_utilization(self, window_s: float, bin_s: float) -> list[BusyBin]:
        """The device's busy fraction over recent wall-clock bins."""
        runtime = self._runtime_if_ready()
        if runtime is None:
            return []
        return [
            BusyBin(start=datetime.fromtimestamp(b.start, UTC), seconds=b.seconds, busy=b.busy)
            for b in runtime.ctx.device.busy_timeline(window_s, bin_s)
        ]

    def pipeline_figures(self) -> PipelineFigures | None:
        """Device, stage, queue and per-job figures for `/metrics`."""
        runtime = self._runtime_if_ready()
        if runtime is None:
            return None
        device, envs = runtime.ctx.device, runtime.ctx.envs
        figures = device.figures()
        recent = device.busy_timeline(60, 60)
        busy_recent = (
            sum(b.busy * b.seconds for b in recent) / sum(b.seconds for b in recent)
            if recent
            else 0.0
        )
        states = runtime.states()
        return PipelineFigures(
            device_busy_fraction=figures.busy_fraction,
            device_busy_fraction_recent=busy_recent,
            decode_busy_s=figures.busy_decode_s,
            train_busy_s=figures.busy_train_s,
            decode_iterations=figures.decode_steps,
            tokens_sampled=figures.tokens_sampled,
            train_steps=figures.train_passes,
            engine_rows=figures.rows_running,
            env_active=envs.active,
            env_calls=envs.stats.calls,
            env_errors=envs.stats.errors,
            env_timeouts=envs.stats.timeouts,
            waiting_requests={t: n for t, n in figures.waiting_by_tenant.items() if t in states},
            job_steps={name: s.version for name, s in states.items()},
            job_staleness_max={name: s.stats.staleness_max for name, s in states.items()},
            job_tokens={t: n for t, n in figures.tokens_by_tenant.items() if t in states},
        )

    # -- JobBackend ------------------------------------------------------------------

    async def submit(self, job_id: str, spec: JobSpec) -> None:
        runtime = await self.ready()
        if self._closing:
            return  # it stays queued in the database: the next start runs it
        if job_id in self._jobs:
            # Created while the pipeline started: recovery read it from the database
            # and runs it already.
            return
        self._run(runtime, job_id, spec, restore=False)

    async def cancel(self, job_id: str) -> None:
        runtime = await self.ready()
        if job_id in self._jobs and not self._closing:
            runtime.cancel(job_id)

    async def pause(self, job_id: str) -> None:
        runtime = await self.ready()
        if self._closing:
            return  # the next start reads the database, which says paused
        self._known(job_id).running = False  # the database says paused
        runtime.pause(job_id)

    async def unpause(self, job_id: str) -> None:
        runtime = await self.ready()
        if self._closing:
            return  # the next start reads the database, which says queued
        job = self._known(job_id)
        if job.ended is not None:
            # It ended while paused and the database took the unpause before that end's
            # report, which it then refused from queued: the runner says it again.
            self._report_end(job_id, job, job.ended, job.reason)
            return
        # The database says queued; the pipeline's `TenantUnpaused` (admitted) or, for a
        # job paused before admission, its `TenantStarted` reports running.
        runtime.unpause(job_id)

    async def close(self) -> None:
        self._closing = True
        try:
            runtime = await self.ready()
        except Exception:
            runtime = None  # it never started; its error is in the log
        if runtime is not None:
            await runtime.close(checkpoint=True)
        self._reports.put_nowait(None)
        await self._worker

    # -- starting and recovery -------------------------------------------------------

    async def _start(
        self, spec: PipelineSpec, options: PipelineOptions, recover: bool
    ) -> PipelineRuntime:
        runtime = await PipelineRuntime.start(
            spec,
            self.out_dir,
            backend=open_backend,
            options=options,
            on_progress=self._on_progress,
            judges=self._judges,
        )
        if recover:
            try:
                await self._recover(runtime)
            except BaseException:
                await runtime.close(checkpoint=False)
                raise
        return runtime

    async def _recover(self, runtime: PipelineRuntime) -> None:
        stored = await asyncio.to_thread(self._active_jobs)
        for job in stored:
            if job.spec is None:
                self._report_failure(job.job_id, f"cannot resume after a restart: {job.error}")
                continue
            known = _Job(checkpoints=set(job.checkpoints), running=job.status is JobStatus.RUNNING)
            for path in list_checkpoints(runtime.ctx.checkpoint_dir(job.job_id)):
                match = _CKPT.match(path.name)
                step = int(match.group(1)) if match else None
                if step is not None and step not in known.checkpoints:
                    # Written, but its record not in the database: it and what it
                    # reported (its step's figures, where the database lacks them).
                    known.checkpoints.add(step)
                    try:
                        figures = reported(path, step)
                    except MarlaasError:
                        figures = Reported(None, {})
                    if figures.step is not None and step not in job.stepped:
                        self._report_step(job.job_id, step, figures.step)
                    self._report_checkpoint(
                        job.job_id, step, path / ADAPTER_DIR, figures.checkpoint
                    )
            try:
                self._run(runtime, job.job_id, job.spec, restore=True, known=known)
            except MarlaasError as e:  # e.g. a spec beyond this server's pipeline sizes
                self._report_failure(job.job_id, f"cannot resume after a restart: {e}")
                continue
            if job.status is JobStatus.PAUSED:
                runtime.pause(job.job_id)  # before admission: it stays out of the queue
        if stored:
            log.info("recovered %d active job(s) from the database", len(stored))

    def _active_jobs(self) -> list[_Stored]:
        out: list[_Stored] = []
        with self._db.transaction() as session:
            jobs = session.scalars(
                select(Job).where(Job.status.in_(list(ACTIVE))).order_by(Job.created_at, Job.id)
            ).all()
            for job in jobs:
                steps = frozenset(
                    session.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job.id))
                )
                stepped = frozenset(  # every step's figures have its loss (evals do not)
                    session.scalars(
                        select(Metric.step).where(Metric.job_id == job.id, Metric.name == "loss")
                    )
                )
                try:
                    spec: JobSpec | None = datasets.resolve_spec(
                        session,
                        job.tenant_id,
                        JobSpec.model_validate(job.spec),
                        self._reporter.artifact_dir,
                    )
                    error = None
                except (ValidationError, MarlaasError) as e:
                    spec, error = None, describe_failure(e)
                out.append(_Stored(job.id, JobStatus(job.status), spec, error, steps, stepped))
        return out

    def _run(
        self,
        runtime: PipelineRuntime,
        job_id: str,
        spec: JobSpec,
        *,
        restore: bool,
        known: _Job | None = None,
    ) -> None:
        """Submit the job under its id (raises on a spec the pipeline cannot take)."""
        try:
            # The pipeline keeps every checkpoint; the reporter applies the job's
            # `keep_checkpoints` (database rows first, then files).
            tenant_spec = JobSpec.model_validate(
                {**spec.model_dump(), "name": job_id, "keep_checkpoints": None}
            )
        except ValidationError as e:
            raise PipelineError(f"job id {job_id!r} cannot name a pipeline tenant: {e}") from e
        self._jobs[job_id] = known or _Job()
        try:
            runtime.submit(tenant_spec, restore=restore)
        except BaseException:
            del self._jobs[job_id]
            raise

    def _known(self, job_id: str) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise PipelineError(f"job {job_id!r} is not running in this server's pipeline")
        return job

    # -- progress -> reports ---------------------------------------------------------

    def _on_progress(self, progress: RuntimeProgress) -> None:
        """On the event loop, in order: queue the matching report."""
        if isinstance(progress, RuntimeFailed):
            for name, known in self._jobs.items():
                if known.ended is None:
                    self._report_failure(name, f"the pipeline failed: {progress.reason}")
            return
        job_id = progress.tenant
        job = self._jobs.get(job_id)
        if job is None:
            return
        if isinstance(progress, TenantStarted):
            if not job.running:
                job.running = True
                self._report(lambda: self._reporter.status(job_id, JobStatus.RUNNING))
        elif isinstance(progress, TenantUnpaused):
            if progress.admitted:  # the database says queued since the unpause
                job.running = True
                self._report(lambda: self._reporter.status(job_id, JobStatus.RUNNING))
        elif isinstance(progress, StepDone):
            self._report_step(job_id, progress.step, progress.metrics.as_dict())
        elif isinstance(progress, EvalDone):
            version, values = progress.version, progress.as_dict()
            self._report(lambda: self._reporter.step(job_id, version, values))
        elif isinstance(progress, CheckpointWritten):
            if progress.version not in job.checkpoints:  # a re-save of a step: recorded
                job.checkpoints.add(progress.version)
                self._report_checkpoint(
                    job_id, progress.version, progress.adapter_path, progress.metrics
                )
        elif isinstance(progress, TenantEnded):
            job.ended, job.reason = progress.status, progress.reason
            self._report_end(job_id, job, progress.status, progress.reason)
        elif isinstance(progress, TenantRestored):
            log.info("job %s resumed from its checkpoint at step %d", job_id, progress.version)
            version = progress.version
            self._report(lambda: self._reporter.restored(job_id, version))

    def _report_end(self, job_id: str, job: _Job, status: JobStatus, reason: str | None) -> None:
        """Report a done or failed end (a cancel, or the pipeline's own stop, reports
        nothing: the database says cancelled, or keeps the job active to restore)."""
        if status is JobStatus.DONE:
            if not job.running:  # done follows running (the database may say queued)
                job.running = True
                self._report(lambda: self._reporter.status(job_id, JobStatus.RUNNING))
            self._report(lambda: self._reporter.status(job_id, JobStatus.DONE))
        elif status is JobStatus.FAILED:
            self._report(lambda: self._reporter.status(job_id, JobStatus.FAILED, reason))

    def _report_step(self, job_id: str, step: int, metrics: dict[str, float]) -> None:
        self._report(lambda: self._reporter.step(job_id, step, metrics))

    def _report_checkpoint(
        self, job_id: str, step: int, path: Path, metrics: dict[str, float]
    ) -> None:
        self._report(lambda: self._reporter.checkpoint(job_id, step, path, metrics))

    def _report_failure(self, job_id: str, reason: str) -> None:
        self._report(lambda: self._reporter.status(job_id, JobStatus.FAILED, reason))

    def _report(self, report: _Report) -> None:
        self._reports.put_nowait(report)

    async def _write_reports(self) -> None:
        """The one writer of reports: in order, each failure logged, never fatal."""
        while (report := await self._reports.get()) is not None:
            try:
                await report()
            except Exception:
                log.exception("a job report could not be written")


def _log_start_failure(task: asyncio.Task[PipelineRuntime]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error(
            "the job pipeline did not start; jobs cannot run: %s",
            describe_failure(task.exception()),  # type: ignore[arg-type]
        )
