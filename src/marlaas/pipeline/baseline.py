"""The synchronous baseline: the conventional RL loop on the same components.

One tenant at a time (priority first, FIFO within a priority), and within each step of
that tenant, strictly in order: sample all P x G episodes together (every model turn of
every episode is submitted at once, so generation is batched by the same engine; the
environment runs between a turn and the next), then build the batch, then train it
(`forward_backward` and `optim_step` of that one tenant, which publishes the new
adapter). Same data stream, seeds, hyper-parameters, evals and checkpoints as the async
pipeline, through the same device, so busy and idle time are measured the same way.

It is honest, not a straw man: generation is batched across the whole step, and an
episode's environment call overlaps the generation of episodes still running. What it
lacks is exactly what the async pipeline adds: the device waits while environments run
and while the next step's rollouts have not started, and no two tenants ever share an
engine iteration or a train step. Staleness is always zero.

Failure isolation is the same: a tenant's error fails that tenant, and the next runs.
The device's failure stops the run and is raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

from marlaas.config.job import JobSpec
from marlaas.obs.progress import TenantEnded, TenantQueued, TenantStarted
from marlaas.pipeline.context import PipelineContext
from marlaas.pipeline.lifecycle import TenantRuntime, gather_all
from marlaas.pipeline.scheduler import AdmissionQueue
from marlaas.pipeline.tenant import (
    JobStatus,
    PipelineError,
    TenantFailure,
    TenantState,
    describe_failure,
)
from marlaas.train.batch import TrainBatchError

log = logging.getLogger(__name__)


class SyncBaseline:
    """Runs jobs one after another, each step generate -> environment -> train."""

    def __init__(self, ctx: PipelineContext, jobs: Sequence[JobSpec]) -> None:
        self.ctx = ctx
        jobs = [ctx.resolve_job(job) for job in jobs]
        self.states = {job.name: TenantState(job, order=i) for i, job in enumerate(jobs)}
        queue = AdmissionQueue()
        for job in jobs:
            queue.push(job.name, job.priority)
        self.order = [queue.pop() for _ in range(len(queue))]

    async def run(self) -> dict[str, TenantState]:
        """Run every job in turn; raises the device's failure."""
        failure = self.ctx.device.failure
        for name in self.order:
            job = self.states[name].job
            self.ctx.recorder.progress(TenantQueued(name, job.steps, job.priority))
        for name in self.order:
            if failure.done():
                raise failure.result()
            task = asyncio.create_task(self._tenant(self.states[name]), name=f"sync:{name}")
            waiters: set[asyncio.Future[Any]] = {task, failure}
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise failure.result()
        return self.states

    async def _tenant(self, state: TenantState) -> None:
        recorder = self.ctx.recorder
        rt = TenantRuntime(self.ctx, state)
        state.transition(JobStatus.RUNNING)
        recorder.progress(TenantStarted(state.name))
        try:
            await rt.setup()
            await self._steps(state, rt)
            state.transition(JobStatus.DONE)
            recorder.progress(TenantEnded(state.name, JobStatus.DONE, None))
        except asyncio.CancelledError:
            if not state.status.terminal:
                state.transition(JobStatus.CANCELLED, state.reason or "the run stopped")
            raise
        except Exception as exc:
            state.transition(JobStatus.FAILED, describe_failure(exc))
            recorder.progress(TenantEnded(state.name, JobStatus.FAILED, state.reason))
        finally:
            try:
                await rt.teardown()
            except Exception:  # the tenant has ended; its status stays what it was
                log.exception("tenant %r: freeing its training state failed", state.name)

    async def _steps(self, state: TenantState, rt: TenantRuntime) -> None:
        if rt.evals and state.version not in state.stats.eval_accuracy:
            await rt.evaluate(state.version)
        P = state.prompts_per_step
        while not state.finished_training:
            indices = [state.launch() for _ in range(P)]
            try:
                groups = await gather_all([rt.play_group(i) for i in indices])
            except BaseException:
                for _ in indices:
                    state.group_lost()
                raise
            for group in groups:
                state.group_done(group)
            batch = state.take_batch()
            if batch is None:
                raise PipelineError(f"tenant {state.name!r}: a synchronous step built no batch")
            submitted = time.perf_counter()
            try:
                result = await rt.train(batch)
            except TrainBatchError as exc:
                raise TenantFailure(
                    f"the trainer rejected the batch of step {batch.step}: {exc}"
                ) from exc
            state.on_trained(batch, result)
            rt.record_step(batch, result, submitted)
            if state.finished_training:
                break
            if rt.checkpoint_due():
                await rt.checkpoint()
            if rt.eval_due():
                await rt.evaluate(state.version)
        if rt.evals and state.version not in state.stats.eval_accuracy:
            await rt.evaluate(state.version)
        await rt.checkpoint()
        await rt.save_adapter()
