"""The device executor: the one thread that runs model compute.

It interleaves decode iterations of the rollout engine (every tenant's rows in one
batch) with multi-lane trainer steps (every ready tenant's batch in one pass), and runs
short control calls on the trainer (register, restore, snapshot, remove) between them,
so the trainer is only ever touched from this thread.

Policy, one decision per turn of the loop:
1. Run queued control calls (they are short and may gate a tenant's next step).
2. If train batches are ready, train all of them in one `trainer.step`, unless the
   previous turn was also a train step and the engine has rows to decode: a batch that
   waits blocks its tenant, so training goes first, but decode is never starved.
   Except while inference rows run (`RequestGate.interactive_active`): the turns then
   belong to inference for a window of at most `MAX_INTERACTIVE_S` -- no train step,
   and no new training rows enter the engine (the ones running keep decoding in the
   same batch) -- so that a completion is neither stretched by a train step after each
   of its tokens nor by the prefill of training rows. When the window ends, training
   gets its turn (the ready batch trains and training rows are admitted once), then
   the next window opens. Inference asking without pause thus gets about half of the
   device at most, and training always progresses.
3. Otherwise move fairly-ordered requests into the engine (`RequestGate.fill`) and run
   one `engine.step()`.
4. With nothing to do, wait on a `threading.Event` that every producer sets (submit,
   train, call, stop): no polling, no sleeping.

After a train step the new adapters are published to the engine in this same thread,
before the next decode iteration, so publication is atomic with respect to iterations;
only then are the results handed to the event loop (`loop.call_soon_threadsafe`).

Busy time is the time inside `engine.step` (decode) and `trainer.step` plus publication
(train); each is recorded as a span of stage "device". Idle time is the time spent
waiting on the event. `busy_fraction` = busy / time since start.

A `TrainBatchError` fails that tenant's batch only (the rest of the step is retried).
Any other exception in this thread is fatal for the run: every pending future fails
with it and `failure` resolves with it, for the supervisor to surface.

The GIL: torch releases it inside each op and takes it back after, so the device thread
re-acquires it thousands of times per step. When the event-loop thread runs Python
without pause, each re-acquisition waits for the interpreter's switch interval (5 ms by
default): a multi-lane train step measured 0.40 s alone and 10-12 s beside one busy
Python thread. While it runs, the executor lowers the switch interval to
`GIL_SWITCH_INTERVAL_S` (the same step: 0.48 s beside the busy thread), and restores
the previous value when it stops. With the event loop not saturated (the usual case)
the setting made no difference to a run's wall time.

Shutdown order (`stop`): set the stop flag and wake the thread -> the thread finishes the
step in progress and exits -> join it -> fail every control call and train batch still
queued with `ExecutorClosed`. The engine is shut down by its owner after this.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future as ThreadFuture
from dataclasses import dataclass
from typing import Any, TypeVar

from marlaas.errors import MarlaasError
from marlaas.obs.history import BusyHistory
from marlaas.obs.recorder import NullRecorder, Recorder
from marlaas.pipeline.scheduler import RequestGate
from marlaas.rollout.engine import RolloutEngine
from marlaas.train.batch import TenantStepResult, TrainBatch, TrainBatchError
from marlaas.train.grpo import GRPOTrainer

#: The interpreter's thread switch interval while an executor runs (see the docstring).
GIL_SWITCH_INTERVAL_S = 1e-5
#: Longest the turns belong to inference rows at a time (policy step 2).
MAX_INTERACTIVE_S = 4.0

T = TypeVar("T")


class ExecutorClosed(MarlaasError, RuntimeError):
    """The device executor stopped before this work ran."""


@dataclass(eq=False)
class _Job:
    batch: TrainBatch
    future: ThreadFuture[TenantStepResult]


class DeviceExecutor:
    """Runs decode iterations, train steps and trainer calls on one thread."""

    def __init__(
        self,
        engine: RolloutEngine,
        trainer: GRPOTrainer,
        gate: RequestGate,
        recorder: Recorder | None = None,
    ) -> None:
        self.engine = engine
        self.trainer = trainer
        self.gate = gate
        self.recorder: Recorder = recorder or NullRecorder()
        gate.on_submit = self.wake
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._jobs: list[_Job] = []
        self._calls: list[tuple[Callable[[], Any], ThreadFuture[Any]]] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failure: asyncio.Future[BaseException] | None = None
        self._started = 0.0
        self._stopped: float | None = None
        self._saved_switch_interval: float | None = None
        #: Policy step 2: when the current inference window ends; what training is owed
        #: before the next one (a train step if a batch was ready, one admission).
        self._window_end: float | None = None
        self._owed_train = False
        self._owed_fill = False
        self.busy_decode_s = 0.0
        self.busy_train_s = 0.0
        self.idle_s = 0.0
        self.decode_steps = 0
        self.train_steps = 0
        self.tokens_sampled = 0
        self.max_lanes = 0
        #: Busy seconds per recent wall-clock second (bounded; for live dashboards).
        self.history = BusyHistory()

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Start the device thread (call from the event loop that awaits results)."""
        if self._thread is not None:
            raise RuntimeError("the device executor is already started")
        self._loop = asyncio.get_running_loop()
        self._failure = self._loop.create_future()
        self._started = time.perf_counter()
        self._saved_switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._saved_switch_interval, GIL_SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._main, name="marlaas-device", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the thread (see the shutdown order in the module docstring)."""
        with self._lock:
            self._stopping = True
        self.wake()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            await asyncio.to_thread(thread.join)
        if self._stopped is None:
            self._stopped = time.perf_counter()
        if self._saved_switch_interval is not None:
            sys.setswitchinterval(self._saved_switch_interval)
            self._saved_switch_interval = None
        self._fail_pending(ExecutorClosed("the device executor stopped before this ran"))

    @property
    def failure(self) -> asyncio.Future[BaseException]:
        """Resolves with the exception that killed the device thread, if one does."""
        if self._failure is None:
            raise RuntimeError("the device executor is not started")
        return self._failure

    def wake(self) -> None:
        self._wake.set()

    # -- work ------------------------------------------------------------------------

    def train(self, batch: TrainBatch) -> asyncio.Future[TenantStepResult]:
        """Queue one tenant's batch; resolves with its step result (new version published)."""
        future: ThreadFuture[TenantStepResult] = ThreadFuture()
        with self._lock:
            self._check_open()
            if any(j.batch.tenant == batch.tenant for j in self._jobs):
                raise RuntimeError(f"tenant {batch.tenant!r} already has a batch queued")
            self._jobs.append(_Job(batch, future))
        self.wake()
        return asyncio.wrap_future(future)

    def call(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Run `fn(*args)` on the device thread between two steps; resolves with its result."""
        future: ThreadFuture[T] = ThreadFuture()
        with self._lock:
            self._check_open()
            self._calls.append((lambda: fn(*args), future))
        self.wake()
        return asyncio.wrap_future(future)

    # -- figures ---------------------------------------------------------------------

    @property
    def busy_s(self) -> float:
        return self.busy_decode_s + self.busy_train_s

    @property
    def elapsed_s(self) -> float:
        end = self._stopped if self._stopped is not None else time.perf_counter()
        return max(end - self._started, 0.0) if self._started else 0.0

    def prompt_tokens(self) -> tuple[int, int]:
        """(prompt tokens the engine ran, prompt tokens whose prefill it shared) so far."""
        stats = self.engine.stats
        return stats.prefill_tokens, stats.shared_prefill_tokens

    @property
    def mean_decode_batch(self) -> float:
        """Tokens sampled per decode iteration: how full the engine's batches were."""
        return self.tokens_sampled / self.decode_steps if self.decode_steps else 0.0

    @property
    def busy_fraction(self) -> float:
        elapsed = self.elapsed_s
        return self.busy_s / elapsed if elapsed > 0 else 0.0

    # -- the thread ------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._stopping:
            raise ExecutorClosed("the device executor is stopping; no new work is accepted")

    def _main(self) -> None:
        try:
            self._run()
        except BaseException as exc:
            self._signal_failure(exc)
            self._fail_pending(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._stopped = time.perf_counter()

    def _run(self) -> None:
        last_was_train = False
        while True:
            self._wake.clear()
            with self._lock:
                if self._stopping:
                    return
                calls, self._calls = self._calls, []
            for fn, future in calls:
                _run_call(fn, future)
            with self._lock:
                ready = bool(self._jobs)
            rows_waiting = self.decodes_here and (self.engine.has_work() or self.gate.has_waiting())
            inference = self._inference_turn(ready)
            if ready and not (last_was_train and rows_waiting) and not inference:
                self._owed_train = False
                self._train()
                last_was_train = True
                continue
            last_was_train = False
            if self.decodes_here:
                self.gate.fill(training=not inference)
                self._owed_fill = self._owed_fill and inference
                if self.engine.has_work() and self._decode() > 0:
                    continue
            with self._lock:
                if self._calls or self._jobs or self._stopping:
                    continue
            t0 = time.perf_counter()
            self._wake.wait()
            self.idle_s += time.perf_counter() - t0

    def _inference_turn(self, ready: bool) -> bool:
        """Whether this turn belongs to inference rows (policy step 2)."""
        if not (self.decodes_here and self.gate.interactive_active()):
            self._window_end, self._owed_train, self._owed_fill = None, False, False
            return False
        if self._owed_train or self._owed_fill:
            return False  # training's turn, between two windows
        now = time.perf_counter()
        if self._window_end is None:
            self._window_end = now + MAX_INTERACTIVE_S
        if now < self._window_end:
            return True
        self._window_end = None
        self._owed_train, self._owed_fill = ready, True
        return False

    def _decode(self) -> int:
        t0 = time.perf_counter()
        rows = self.engine.running
        n = self.engine.step()
        t1 = time.perf_counter()
        self.busy_decode_s += t1 - t0
        if n > 0:
            self.decode_steps += 1
            self.tokens_sampled += n
            self.history.add(t0, t1)
            self.recorder.span("device", "decode", t0, t1, args={"tokens": n, "rows": rows})
        return n

    def _train(self) -> None:
        with self._lock:
            taken, self._jobs = self._jobs, []
        jobs = [j for j in taken if j.future.set_running_or_notify_cancel()]
        t0 = time.perf_counter()
        try:
            results = self._step_and_publish(jobs)
        except BaseException as exc:
            self._signal_failure(exc)  # before the tenants hear of it: the run's failure
            for j in jobs:
                if not j.future.done():
                    j.future.set_exception(exc)
            raise
        jobs = [j for j in jobs if j.batch.tenant in results]
        t1 = time.perf_counter()
        if jobs:
            self.busy_train_s += t1 - t0
            self.train_steps += 1
            self.max_lanes = max(self.max_lanes, len(jobs))
            self.history.add(t0, t1)
            self.recorder.span(
                "device",
                "train",
                t0,
                t1,
                args={
                    "tenants": [j.batch.tenant for j in jobs],
                    "rows": sum(len(j.batch.trajectories) for j in jobs),
                },
            )
        for j in jobs:
            j.future.set_result(results[j.batch.tenant])

    def _step_and_publish(self, jobs: list[_Job]) -> dict[str, TenantStepResult]:
        results: dict[str, TenantStepResult] = {}
        while jobs:
            try:
                results = self._trainer_step([j.batch for j in jobs])
                break
            except TrainBatchError as exc:  # that tenant's batch only; retry the rest
                bad = [j for j in jobs if j.batch.tenant == exc.tenant]
                if not bad:
                    raise
                for j in bad:
                    j.future.set_exception(exc)
                jobs = [j for j in jobs if j.batch.tenant != exc.tenant]
        for j in jobs:
            self._publish(j.batch.tenant, results[j.batch.tenant].version)
        return results

    # -- where the work runs (a distributed executor overrides these) ------------------

    #: Whether this thread decodes (in-process); False when replicas decode on their own.
    decodes_here = True

    def _trainer_step(self, batches: list[TrainBatch]) -> dict[str, TenantStepResult]:
        return self.trainer.step(batches)

    def _publish(self, tenant: str, version: int) -> None:
        self.engine.publish(tenant, version, self.trainer.adapter(tenant))

    def _signal_failure(self, exc: BaseException) -> None:
        """Close the executor and resolve `failure` (callbacks run in order on the loop,
        so the supervisor learns of it before any tenant's future fails)."""
        with self._lock:
            self._stopping = True  # nothing may queue work for a dead thread
        loop, failure = self._loop, self._failure
        if loop is not None and failure is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_set_once, failure, exc)

    def _fail_pending(self, exc: BaseException) -> None:
        with self._lock:
            jobs, self._jobs = self._jobs, []
            calls, self._calls = self._calls, []
        for j in jobs:
            if not j.future.done():
                j.future.set_exception(exc)
        for _, future in calls:
            if not future.done():
                future.set_exception(exc)


def _run_call(fn: Callable[[], Any], future: ThreadFuture[Any]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn()
    except Exception as exc:  # the caller's error, delivered to the caller
        future.set_exception(exc)
    else:
        future.set_result(result)


def _set_once(future: asyncio.Future[BaseException], exc: BaseException) -> None:
    if not future.done():
        future.set_result(exc)
