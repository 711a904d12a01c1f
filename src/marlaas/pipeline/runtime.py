"""A long-lived pipeline for a process that runs jobs as they come (the service).

`PipelineRuntime.start` takes a validated `PipelineSpec` (the one spec every pipeline is
built from; `marlaas run` gives a `RunSpec`, which is one plus its jobs), opens the
backend once with the caller's `BackendOpener` (as `marlaas run` does), starts a
serve-mode `Orchestrator`, and returns a ready runtime. The jobs' `max_staleness` is
bounded by the spec's `staleness_limit` (its `max_staleness`, default 4).
Jobs are then submitted, paused, unpaused and cancelled at any time; tenant names are the job names and are unique for the
runtime's life.

Progress reaches the owner through one callback: every typed progress record the
pipeline emits (`marlaas.obs.progress`: a tenant queued, started, paused, restored from
a checkpoint, a step trained with its figures, an eval, a checkpoint written, a tenant
ended with its status and reason), the very records its recorder gets, and
`RuntimeFailed` if the pipeline itself fails. The callback runs on the event loop and
must not block; it is called in the order things happened.

Restoring is per job: the context is built with `restore=True`, so a tenant restores
from its latest checkpoint (adapter, optimizer, data cursor, eval history) when one
exists. `submit(job, restore=False)` therefore refuses a job whose checkpoint directory
already holds checkpoints: it would silently continue them.

Shutdown order (`close`): the orchestrator closes (admits nothing more; with
`checkpoint=True` every admitted tenant lets its train step in flight land and writes a
checkpoint of what it trained since its last one) -> its `run` returns once every
tenant has ended -> close the backend (the device, then the environment pool).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from marlaas.config.job import JobSpec, PipelineSpec
from marlaas.fileio import atomic_write_json
from marlaas.obs.progress import Progress, TenantEnded
from marlaas.obs.recorder import NullRecorder, Recorder
from marlaas.pipeline.context import BackendOpener, PipelineContext, PipelineOptions
from marlaas.pipeline.judges import JudgeFactory
from marlaas.pipeline.orchestrator import Orchestrator
from marlaas.pipeline.tenant import PipelineError, TenantState, describe_failure
from marlaas.train.checkpoint import list_checkpoints

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeFailed:
    """The shared pipeline itself failed (the device died); nothing runs."""

    reason: str


#: What the runtime's owner hears: every tenant's progress records, and its own failure.
RuntimeProgress = Progress | RuntimeFailed
ProgressCallback = Callable[[RuntimeProgress], None]


def _drop(progress: RuntimeProgress) -> None:
    return None


@dataclass(eq=False)
class _ProgressRecorder:
    """Forwards every record to `inner` and passes the progress records on to `emit`."""

    inner: Recorder
    emit: ProgressCallback
    loop: asyncio.AbstractEventLoop
    _loop_thread: int = field(default_factory=threading.get_ident)

    def span(
        self,
        stage: str,
        name: str,
        start: float,
        end: float,
        *,
        tenant: str | None = None,
        args: Mapping[str, object] | None = None,
    ) -> None:
        self.inner.span(stage, name, start, end, tenant=tenant, args=args)

    def progress(self, record: Progress) -> None:
        self.inner.progress(record)
        if threading.get_ident() == self._loop_thread:
            self._deliver(record)
        else:  # records come from the loop today; stay safe if a thread reports
            self.loop.call_soon_threadsafe(self._deliver, record)

    def event(self, name: str, *, tenant: str | None = None, **fields: object) -> None:
        self.inner.event(name, tenant=tenant, **fields)

    def _deliver(self, progress: Progress) -> None:
        try:
            self.emit(progress)
        except Exception:  # the owner's bug must not stop the tenants' work
            log.exception("the progress callback failed on %r", progress)


class PipelineRuntime:
    """A running long-lived pipeline (see the module docstring); build it with `start`."""

    def __init__(
        self,
        ctx: PipelineContext,
        orchestrator: Orchestrator,
        on_progress: ProgressCallback | None,
    ) -> None:
        """Private: use `PipelineRuntime.start`."""
        self.ctx = ctx
        self._orch = orchestrator
        self._on_progress = on_progress
        self._ended: dict[str, asyncio.Event] = {}
        self._closing = False
        self._closed = asyncio.Event()
        self.failure: BaseException | None = None
        self._task: asyncio.Task[dict[str, TenantState]] = asyncio.create_task(
            orchestrator.run(), name="pipeline-runtime"
        )
        self._task.add_done_callback(self._run_ended)

    @classmethod
    async def start(
        cls,
        spec: PipelineSpec,
        out_dir: Path,
        *,
        backend: BackendOpener,
        options: PipelineOptions | None = None,
        recorder: Recorder | None = None,
        on_progress: ProgressCallback | None = None,
        judges: JudgeFactory | None = None,
    ) -> PipelineRuntime:
        """Open the backend (`backend`: e.g. `marlaas.backends.open_backend`) and start
        the orchestrator. Tenant outputs go under `out_dir/tenants/<job name>/`.
        `judges` answers the jobs' model graders (None: such jobs are refused)."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out_dir / "runtime.json", spec.model_dump(mode="json"), sort_keys=True)
        # Nothing is emitted before a job runs; the runtime takes the records once built.
        progress = _ProgressRecorder(recorder or NullRecorder(), _drop, asyncio.get_running_loop())
        ctx = await PipelineContext.open(
            spec,
            out_dir,
            backend=backend,
            recorder=progress,
            options=options,
            restore=True,
            judges=judges,
        )
        runtime = cls(ctx, Orchestrator(ctx, serve=True), on_progress)
        progress.emit = runtime._progress
        return runtime

    # -- jobs ------------------------------------------------------------------------

    def submit(self, job: JobSpec, *, restore: bool) -> TenantState:
        """Queue `job`. `restore=True` continues from its latest checkpoint, if any;
        `restore=False` requires that it has none. Raises `PipelineError` (closed, name
        taken, stale checkpoints) or `ConfigError` (a spec beyond the runtime's sizes)."""
        self._check_open()
        if not restore:
            found = list_checkpoints(self.ctx.checkpoint_dir(job.name))
            if found:
                raise PipelineError(
                    f"job {job.name!r} already has checkpoints under "
                    f"{self.ctx.checkpoint_dir(job.name)}; submit it with restore=True to "
                    "continue from them, or give the job a new name"
                )
        state = self._orch.submit(job)
        self._ended[job.name] = asyncio.Event()
        return state

    def cancel(self, name: str) -> None:
        """Stop the job for good (no checkpoint is written)."""
        self._orch.cancel(name)

    def pause(self, name: str) -> None:
        """Stop scheduling the job's work; its in-flight work lands, its state stays."""
        self._orch.pause(name)

    def unpause(self, name: str) -> None:
        """Schedule a paused job again (a job paused before admission queues again)."""
        self._orch.unpause(name)

    def states(self) -> dict[str, TenantState]:
        """Every job submitted to this pipeline, by name (a snapshot of the mapping)."""
        return dict(self._orch.states)

    def state(self, name: str) -> TenantState:
        state = self._orch.states.get(name)
        if state is None:
            raise PipelineError(f"no job named {name!r} was submitted to this pipeline")
        return state

    async def wait(self, name: str) -> TenantState:
        """Wait until the job `name` has ended; returns its final state."""
        state = self.state(name)
        await self._ended[name].wait()
        return state

    @property
    def running(self) -> bool:
        return not self._closing and not self._task.done()

    def _check_open(self) -> None:
        if self._closing:
            raise PipelineError("the pipeline is closing; it takes no new jobs")
        if self._task.done():
            raise PipelineError(
                "the pipeline has stopped"
                + (f": {describe_failure(self.failure)}" if self.failure else "")
            )

    # -- shutdown --------------------------------------------------------------------

    async def close(self, *, checkpoint: bool = True) -> None:
        """Stop everything in the order of the module docstring; a second call waits for
        the first. Does not raise the pipeline's own failure (see `failure`)."""
        if self._closing:
            await self._closed.wait()
            return
        self._closing = True
        try:
            self._orch.close(checkpoint=checkpoint)
            await asyncio.wait([self._task])
        finally:
            await self.ctx.backend.close()
            self._closed.set()

    # -- progress --------------------------------------------------------------------

    def _progress(self, progress: RuntimeProgress) -> None:
        if isinstance(progress, TenantEnded) and progress.tenant in self._ended:
            self._ended[progress.tenant].set()
        if self._on_progress is not None:
            self._on_progress(progress)

    def _run_ended(self, task: asyncio.Task[dict[str, TenantState]]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        self.failure = exc
        log.error("the pipeline failed: %s", describe_failure(exc))
        for event in self._ended.values():
            event.set()
        if self._on_progress is not None:
            try:
                self._on_progress(RuntimeFailed(describe_failure(exc)))
            except Exception:
                log.exception("the progress callback failed on the pipeline's failure")
