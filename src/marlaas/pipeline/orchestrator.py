"""The event-driven asynchronous multi-tenant pipeline.

A supervised tenant's driver is `SupervisedRuntime.run` (steps one after another, no
rollouts); the rest of this docstring is about RL tenants, and so is `_drive`.

Every admitted tenant has one driver task and short-lived child tasks: one per GRPO group
being sampled, one for its train step in flight, one per eval. The driver wakes on an
`asyncio.Event` that every child sets when it ends; it then builds the next train batch
(`TenantState.take_batch`: P fresh groups, stale ones dropped) and launches new groups
while `TenantState.can_launch` allows. Nothing polls and nothing waits for another
tenant: a tenant blocks only on its own groups, its own train step and, before training
step j, on its own evals of versions that step j would push out of the adapter bank.

Supervision: the orchestrator's `run` admits jobs (`AdmissionQueue`: at most
`max_active_tenants`, priority first, FIFO within a priority) and watches the tenant
tasks and the device. A tenant's error of any kind (its env, grader, data, a rejected
batch) fails that tenant only, with the reason recorded; the device's failure is the
run's, and is raised after every tenant is cancelled.

Progress: every change of a tenant's state (queued, admitted, paused, unpaused, ended
with its status and reason) is reported as a typed record (`marlaas.obs.progress`)
through `ctx.recorder.progress`, and so are its steps, evals, checkpoints and restores
(`TenantRuntime`); the recorder, the live view, the plots, the service and the estimate
read those records, never names of metrics or events.

Jobs arrive at construction or later through `submit` (names are unique for the
orchestrator's life). By default `run` returns once every job is terminal; with
`serve=True` it keeps waiting (on its wake event, never a timer) for new jobs until
`close` is called. `close(checkpoint=True)` is the graceful stop: nothing more is
admitted, queued jobs end cancelled, and every admitted tenant stops launching work,
lets its train step in flight land, writes a checkpoint if it trained since its last
one, and ends cancelled with a "stopped" reason (a later resume continues from there).

Shutdown order (end of `run`, normal or not): stop admitting -> cancel the tenant tasks
still running (each cancels its children, whose sampling requests are withdrawn or
aborted, then drops its training state from the device) -> wait for them. The owner of
the context then closes the backend (`runner.run_jobs`, `runtime.PipelineRuntime.close`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Sequence
from typing import Any

from marlaas.config.job import JobSpec
from marlaas.errors import ConfigError
from marlaas.obs.progress import (
    TenantEnded,
    TenantPaused,
    TenantQueued,
    TenantStarted,
    TenantUnpaused,
)
from marlaas.pipeline.context import PipelineContext
from marlaas.pipeline.lifecycle import TenantRuntime
from marlaas.pipeline.scheduler import AdmissionQueue
from marlaas.pipeline.supervised import SupervisedRuntime
from marlaas.pipeline.tenant import (
    JobStatus,
    PipelineError,
    TenantFailure,
    TenantState,
    describe_failure,
)
from marlaas.train.batch import TrainBatch, TrainBatchError

log = logging.getLogger(__name__)


class _Tasks:
    """A tenant's child tasks: the first error is kept, every end wakes the driver."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.wake = asyncio.Event()
        self.children: set[asyncio.Task[Any]] = set()
        self.errors: list[BaseException] = []
        self.evals: dict[int, asyncio.Task[Any]] = {}

    def spawn(self, coro: Coroutine[Any, Any, Any], what: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=f"tenant:{self.name}:{what}")
        self.children.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self.children.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.errors.append(task.exception())  # type: ignore[arg-type]
        self.wake.set()

    def pending_eval_versions(self) -> list[int]:
        return [v for v, t in self.evals.items() if not t.done()]

    async def cancel_all(self) -> None:
        for task in list(self.children):
            task.cancel()
        if self.children:
            await asyncio.gather(*self.children, return_exceptions=True)


class _Stopped(Exception):
    """A tenant stopped because the orchestrator is closing (not a failure)."""


class Orchestrator:
    """Runs jobs on a `PipelineContext`'s shared components (see the module docstring)."""

    def __init__(
        self, ctx: PipelineContext, jobs: Sequence[JobSpec] = (), *, serve: bool = False
    ) -> None:
        self.ctx = ctx
        self.states: dict[str, TenantState] = {}
        self._queue = AdmissionQueue()
        #: Queued jobs paused before admission: out of the queue until unpaused.
        self._held: set[str] = set()
        self._serve = serve
        self._closing = False
        self._checkpoint_on_close = True
        self._drivers: dict[str, asyncio.Task[None]] = {}
        self._tasks: dict[str, _Tasks] = {}
        self._wake = asyncio.Event()
        self.admission_order: list[str] = []
        for job in jobs:
            self.submit(job)

    # -- control ---------------------------------------------------------------------

    def submit(self, job: JobSpec) -> TenantState:
        """Queue a new job (admitted when there is room, priority first)."""
        if self._closing:
            raise PipelineError(f"cannot submit job {job.name!r}: the pipeline is closing")
        if job.name in self.states:
            raise PipelineError(
                f"a job named {job.name!r} was already submitted to this pipeline; "
                "job names must be unique for the pipeline's life"
            )
        device = self.ctx.device
        if job.lora.rank > device.model.max_rank:
            raise ConfigError(
                f"job {job.name!r}: lora.rank {job.lora.rank} is above the engine's "
                f"max_rank {device.model.max_rank}; lower the rank"
            )
        job = self.ctx.resolve_job(job)
        limit = self.ctx.run.staleness_limit  # the device keeps `run.versions_kept`
        if not job.supervised and job.grpo.max_staleness > limit:
            raise ConfigError(
                f"job {job.name!r}: algorithm.max_staleness {job.grpo.max_staleness} is "
                f"above this pipeline's limit of {limit}; lower it"
            )
        state = self.states[job.name] = TenantState(job, order=len(self.states))
        self._queue.push(job.name, job.priority)
        self.ctx.recorder.progress(TenantQueued(job.name, job.steps, job.priority))
        self._wake.set()
        return state

    def _state(self, name: str) -> TenantState:
        state = self.states.get(name)
        if state is None:
            raise PipelineError(f"no job named {name!r} was submitted to this pipeline")
        return state

    def pause(self, name: str) -> None:
        """Stop launching groups and training for `name` (in-flight work finishes). A
        queued job leaves the admission queue until unpaused; pausing a paused or
        finished job does nothing."""
        state = self._state(name)
        if state.status is JobStatus.QUEUED:
            if self._queue.remove(name):
                self._held.add(name)
                self.ctx.recorder.progress(TenantPaused(name, admitted=False))
            return
        if state.status is JobStatus.RUNNING:
            state.transition(JobStatus.PAUSED)
            self.ctx.recorder.progress(TenantPaused(name, admitted=True))
            self._poke(name)

    def unpause(self, name: str) -> None:
        """Undo `pause` (a job paused before admission is queued again, at the back of
        its priority); unpausing a running or finished job does nothing."""
        state = self._state(name)
        if name in self._held:
            self._held.discard(name)
            self._queue.push(name, state.job.priority)
            self.ctx.recorder.progress(TenantUnpaused(name, admitted=False))
            self._wake.set()
        elif state.status is JobStatus.PAUSED:
            state.transition(JobStatus.RUNNING)
            self.ctx.recorder.progress(TenantUnpaused(name, admitted=True))
            self._poke(name)

    def cancel(self, name: str) -> None:
        """Cancel a queued, paused or running job."""
        state = self._state(name)
        if state.status.terminal:
            return
        if self._queue.remove(name) or name in self._held:
            self._held.discard(name)
            state.transition(JobStatus.CANCELLED, "cancelled before admission")
            self.ctx.recorder.progress(TenantEnded(name, JobStatus.CANCELLED, state.reason))
            self._wake.set()
            return
        state.reason = "cancelled"
        driver = self._drivers.get(name)
        if driver is not None:
            driver.cancel()

    def close(self, *, checkpoint: bool = True) -> None:
        """Stop (see the module docstring); `run` returns once every tenant has ended.
        With `checkpoint=False` admitted tenants are cancelled without a checkpoint."""
        if self._closing:
            return
        self._closing = True
        self._checkpoint_on_close = checkpoint
        waiting = [name for name in self.states if name in self._queue or name in self._held]
        for name in waiting:
            self._queue.remove(name)
            self._held.discard(name)
            self.states[name].transition(JobStatus.CANCELLED, "the pipeline closed first")
            reason = self.states[name].reason
            self.ctx.recorder.progress(TenantEnded(name, JobStatus.CANCELLED, reason))
        for name, driver in self._drivers.items():
            if checkpoint:
                self._poke(name)
            else:
                self.states[name].reason = "the pipeline closed"
                driver.cancel()
        self._wake.set()

    def _stopping(self) -> bool:
        """Whether admitted tenants should checkpoint and stop (a graceful close)."""
        return self._closing and self._checkpoint_on_close

    def _poke(self, name: str) -> None:
        tasks = self._tasks.get(name)
        if tasks is not None:
            tasks.wake.set()

    # -- supervision -----------------------------------------------------------------

    async def run(self) -> dict[str, TenantState]:
        """Run every job to a terminal state (in serve mode: until `close`); raises the
        device's failure."""
        failure = self.ctx.device.failure
        failure.add_done_callback(lambda _: self._wake.set())
        limit = self.ctx.run.max_active_tenants
        try:
            while True:
                self._wake.clear()
                if failure.done():
                    raise failure.result()
                for name, driver in list(self._drivers.items()):
                    if driver.done():
                        del self._drivers[name]
                while self._queue and len(self._drivers) < limit and not self._closing:
                    self._admit(self._queue.pop())
                idle = not self._queue and not self._held
                if not self._drivers and (self._closing or (idle and not self._serve)):
                    return self.states
                await self._wake.wait()
        finally:
            for name, driver in self._drivers.items():
                if not driver.done():
                    self.states[name].reason = self.states[name].reason or "the run stopped"
                    driver.cancel()
            if self._drivers:
                await asyncio.gather(*self._drivers.values(), return_exceptions=True)

    def _admit(self, name: str) -> None:
        self.admission_order.append(name)
        # Running from admission on, so a pause that comes before the driver's first
        # turn applies to an admitted tenant.
        self.states[name].transition(JobStatus.RUNNING)
        self.ctx.recorder.progress(TenantStarted(name))
        driver = asyncio.create_task(self._tenant_main(self.states[name]), name=f"tenant:{name}")
        driver.add_done_callback(lambda _: self._wake.set())
        self._drivers[name] = driver

    async def _tenant_main(self, state: TenantState) -> None:
        recorder = self.ctx.recorder
        tasks = self._tasks[state.name] = _Tasks(state.name)
        supervised = state.job.supervised
        runtime = (SupervisedRuntime if supervised else TenantRuntime)(self.ctx, state)
        try:
            await runtime.setup()
            if isinstance(runtime, SupervisedRuntime):
                if not await runtime.run(self._stopping, tasks.wake):
                    raise _Stopped()
            else:
                await self._drive(state, runtime, tasks)
            state.transition(JobStatus.DONE)
            recorder.progress(TenantEnded(state.name, JobStatus.DONE, None))
        except _Stopped:
            reason = f"stopped with the pipeline at version {state.version}"
            if runtime.last_checkpoint is not None:
                reason += f" (checkpoint at version {runtime.last_checkpoint})"
            state.transition(JobStatus.CANCELLED, reason)
            recorder.progress(TenantEnded(state.name, JobStatus.CANCELLED, reason, stopped=True))
        except asyncio.CancelledError:
            if not state.status.terminal:
                state.transition(JobStatus.CANCELLED, state.reason or "cancelled")
                recorder.progress(TenantEnded(state.name, JobStatus.CANCELLED, state.reason))
            raise
        except Exception as exc:
            if not state.status.terminal:
                state.transition(JobStatus.FAILED, describe_failure(exc))
                recorder.progress(TenantEnded(state.name, JobStatus.FAILED, state.reason))
        finally:
            await tasks.cancel_all()
            state.buffer.clear()  # never trained now; a long-lived pipeline keeps states
            self._tasks.pop(state.name, None)
            try:
                await runtime.teardown()
            except Exception:  # the tenant has ended; its status stays what it was
                log.exception("tenant %r: freeing its training state failed", state.name)

    async def _drive(self, state: TenantState, rt: TenantRuntime, tasks: _Tasks) -> None:
        kept = self.ctx.device.versions_kept
        # The eval before training, or one that was due where a resumed tenant continues
        # (not an extra one at every resume point).
        first_due = state.version == 0 or rt.eval_due()
        if rt.evals and first_due and state.version not in state.stats.eval_accuracy:
            tasks.evals[state.version] = tasks.spawn(rt.evaluate(state.version), "eval")
        while True:
            tasks.wake.clear()
            if tasks.errors:
                raise tasks.errors[0]
            if self._closing and self._checkpoint_on_close:
                if not state.training and not state.holds:  # the step in flight landed
                    await self._stop(state, rt, tasks)
                await tasks.wake.wait()
                continue
            if state.finished_training and not state.training and not state.holds:
                break
            # Training step j publishes version j + 1, and the bank then drops version
            # j + 1 - kept: evals of such versions must have finished first.
            evals_ok = all(v >= state.version + 2 - kept for v in tasks.pending_eval_versions())
            if evals_ok:
                batch = state.take_batch()
                if batch is not None:
                    tasks.spawn(self._train(state, rt, tasks, batch), f"train-{batch.step}")
            while state.can_launch():
                index = state.launch()
                tasks.spawn(self._group(state, rt, index), f"group-{index}")
            await tasks.wake.wait()
        final = state.version
        if rt.evals and final not in state.stats.eval_accuracy and final not in tasks.evals:
            tasks.evals[final] = tasks.spawn(rt.evaluate(final), "eval")
        while tasks.pending_eval_versions():
            tasks.wake.clear()
            if self._closing and self._checkpoint_on_close:
                await self._stop(state, rt, tasks)
            if tasks.errors:
                raise tasks.errors[0]
            await tasks.wake.wait()
        for task in list(tasks.evals.values()):
            await task
        await rt.checkpoint()
        await rt.save_adapter()

    async def _stop(self, state: TenantState, rt: TenantRuntime, tasks: _Tasks) -> None:
        """Closing: drop the tenant's rollouts and evals, checkpoint what it trained
        since its last checkpoint, and end its driver (raises `_Stopped`)."""
        await tasks.cancel_all()
        if state.version > 0 and state.version != rt.last_checkpoint:
            await rt.checkpoint()
        raise _Stopped()

    async def _group(self, state: TenantState, rt: TenantRuntime, index: int) -> None:
        try:
            group = await rt.play_group(index)
        except BaseException:
            state.group_lost()
            raise
        state.group_done(group)

    async def _train(
        self, state: TenantState, rt: TenantRuntime, tasks: _Tasks, batch: TrainBatch
    ) -> None:
        submitted = time.perf_counter()
        try:
            result = await rt.train(batch)
        except TrainBatchError as exc:
            state.train_failed()
            raise TenantFailure(
                f"the trainer rejected the batch of step {batch.step}: {exc}"
            ) from exc
        state.on_trained(batch, result)
        rt.record_step(batch, result, submitted)
        if rt.checkpoint_due() and not state.finished_training:
            state.holds += 1  # the snapshot must show this step, not the next one
            try:
                await rt.checkpoint()
            finally:
                state.holds -= 1
        if rt.eval_due() and state.version not in tasks.evals and not state.finished_training:
            tasks.evals[state.version] = tasks.spawn(rt.evaluate(state.version), "eval")
