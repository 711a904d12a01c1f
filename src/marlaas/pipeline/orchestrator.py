"""The event-driven asynchronous multi-tenant pipeline.

Every admitted tenant has one driver task and short-lived child tasks: one per GRPO group
being sampled, one for its train step in flight, one per eval. The driver wakes on an
`asyncio.Event` that every child sets when it ends; it then builds the next train batch
(`TenantState.take_batch`: P fresh groups, stale ones dropped) and launches new groups
while `TenantState.can_launch` allows. Nothing polls and nothing waits for another
tenant: a tenant blocks only on its own groups, its own train step and, before training
step j, on its own evals of versions that step j would push out of the adapter bank.

Supervision: the orchestrator's `run` admits jobs (`AdmissionQueue`: at most
`max_active_tenants`, priority first, FIFO within a priority) and watches the tenant
tasks and the device executor. A tenant's error of any kind (its env, grader, data, a
rejected batch) fails that tenant only, with the reason recorded; the device executor's
failure is the run's, and is raised after every tenant is cancelled.

Shutdown order (end of `run`, normal or not): stop admitting -> cancel the tenant tasks
still running (each cancels its children, whose engine requests are withdrawn or aborted,
then releases its gate queue and trainer state) -> wait for them. The owner of the
context then stops the device executor and shuts the engine down (`runner.run_jobs`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine, Sequence
from typing import Any

from marlaas.config.job import JobSpec
from marlaas.pipeline.context import PipelineContext
from marlaas.pipeline.lifecycle import TenantRuntime
from marlaas.pipeline.scheduler import AdmissionQueue
from marlaas.pipeline.tenant import TenantFailure, TenantState, TenantStatus, describe_failure
from marlaas.train.batch import TrainBatch, TrainBatchError


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


class Orchestrator:
    """Runs jobs on a `PipelineContext`'s shared components (see the module docstring)."""

    def __init__(self, ctx: PipelineContext, jobs: Sequence[JobSpec]) -> None:
        self.ctx = ctx
        self.states: dict[str, TenantState] = {
            job.name: TenantState(job, order=i) for i, job in enumerate(jobs)
        }
        self._queue = AdmissionQueue()
        for job in jobs:
            self._queue.push(job.name, job.priority)
            ctx.recorder.event("tenant_queued", tenant=job.name, priority=job.priority)
        self._drivers: dict[str, asyncio.Task[None]] = {}
        self._tasks: dict[str, _Tasks] = {}
        self._wake = asyncio.Event()
        self.admission_order: list[str] = []

    # -- control ---------------------------------------------------------------------

    def pause(self, name: str) -> None:
        """Stop launching groups and training for `name` (in-flight work finishes)."""
        self.states[name].transition(TenantStatus.PAUSED)
        self._poke(name)

    def unpause(self, name: str) -> None:
        self.states[name].transition(TenantStatus.RUNNING)
        self._poke(name)

    def cancel(self, name: str) -> None:
        """Cancel a queued or running job."""
        state = self.states[name]
        if state.status.terminal:
            return
        if self._queue.remove(name):
            state.transition(TenantStatus.CANCELLED, "cancelled before admission")
            self._wake.set()
            return
        state.reason = "cancelled"
        driver = self._drivers.get(name)
        if driver is not None:
            driver.cancel()

    def _poke(self, name: str) -> None:
        tasks = self._tasks.get(name)
        if tasks is not None:
            tasks.wake.set()

    # -- supervision -----------------------------------------------------------------

    async def run(self) -> dict[str, TenantState]:
        """Run every job to a terminal state; raises the device executor's failure."""
        failure = self.ctx.executor.failure
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
                while self._queue and len(self._drivers) < limit:
                    self._admit(self._queue.pop())
                if not self._drivers and not self._queue:
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
        driver = asyncio.create_task(self._tenant_main(self.states[name]), name=f"tenant:{name}")
        driver.add_done_callback(lambda _: self._wake.set())
        self._drivers[name] = driver

    async def _tenant_main(self, state: TenantState) -> None:
        recorder = self.ctx.recorder
        tasks = self._tasks[state.name] = _Tasks(state.name)
        runtime = TenantRuntime(self.ctx, state)
        state.transition(TenantStatus.RUNNING)
        recorder.event("tenant_admitted", tenant=state.name)
        try:
            await runtime.setup()
            await self._drive(state, runtime, tasks)
            state.transition(TenantStatus.DONE)
            recorder.event("tenant_done", tenant=state.name, version=state.version)
        except asyncio.CancelledError:
            if not state.status.terminal:
                state.transition(TenantStatus.CANCELLED, state.reason or "cancelled")
                recorder.event("tenant_cancelled", tenant=state.name, reason=state.reason)
            raise
        except Exception as exc:
            if not state.status.terminal:
                state.transition(TenantStatus.FAILED, describe_failure(exc))
                recorder.event("tenant_failed", tenant=state.name, reason=state.reason)
        finally:
            await tasks.cancel_all()
            with contextlib.suppress(Exception):
                await runtime.teardown()

    async def _drive(self, state: TenantState, rt: TenantRuntime, tasks: _Tasks) -> None:
        kept = self.ctx.bank.versions_kept
        if rt.evals and state.version not in state.stats.eval_accuracy:
            tasks.evals[state.version] = tasks.spawn(rt.evaluate(state.version), "eval")
        while True:
            tasks.wake.clear()
            if tasks.errors:
                raise tasks.errors[0]
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
        for task in list(tasks.evals.values()):
            await task
        await rt.checkpoint()
        await rt.save_adapter()

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
            result = await self.ctx.executor.train(batch)
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
