"""The device executor: the one thread that runs model compute.

It interleaves engine iterations (every tenant's rows in one batch), where the compute
`decodes_here`, with the port's calls on tenants' state: multi-lane training passes
(every pending `forward_backward` of every tenant in one pass), batched optimizer steps
and control calls (add, restore, snapshot, export, drop), so the trainer is only ever
touched from this thread. What runs in one turn, and in which order, is `ops.take`'s
rule: each tenant's calls in the order they were made; different tenants' calls
coalesced.

Policy, one decision per turn of the loop:
1. Take the ops of this turn and run them by phase: adds, one forward_backward pass,
   one forward pass, one batched optimizer step (each new version published before its
   result is delivered), then snapshots, exports and drops. Passes are held back when
   the previous turn ran a pass and the engine has rows to decode: a pass that waits
   blocks its tenants, so training goes first, but decode is never starved. A
   forward_backward pass of few tenants also waits a few engine iterations for more of
   the tenants that are training to join it (`ops.PassGathering`).
   Except while inference rows run (`RequestGate.interactive_active`): the turns then
   belong to inference for a window of at most `MAX_INTERACTIVE_S` -- no pass, and no
   new training rows enter the engine (the ones running keep decoding in the same
   batch) -- so that a completion is neither stretched by a pass after each of its
   tokens nor by the prefill of training rows. When the window ends, training gets its
   turn (the waiting passes run and training rows are admitted once), then the next
   window opens. Inference asking without pause thus gets about half of the device at
   most, and training always progresses.
2. Otherwise (or after cheap ops only) run one engine iteration (`Compute.decode`),
   filling it from the fair-share gate first.
3. With nothing to do, wait on a `threading.Event` that every producer sets (a call, a
   sampling request, stop): no polling, no sleeping.

Results reach the event loop through `concurrent.futures.Future`s wrapped for asyncio,
so a result is only seen after everything its op did (publication included) is done.

Busy time is the time inside engine iterations (decode) and inside passes, optimizer
steps and publication (train); each is recorded as a span of stage "device" ("decode";
"train" for forward_backward passes and optimizer steps, "forward" for forward passes). Idle time
is the time spent waiting on the event. `busy_fraction` = busy / (elapsed x the
compute's accelerators); the replicas' decode figures come from the compute where it
does not decode here.

Errors: an input the trainer refuses (`TrainBatchError`, naming its tenant) fails the
ops that carry that tenant's input and the pass is retried with the rest; a call on a
tenant the device does not hold fails with `TenantNotFound`; a control call's own
error is its caller's. Any other exception in this thread is fatal: every pending
future fails with it and `failure` resolves with it, for the supervisor to surface.

The GIL: torch releases it inside each op and takes it back after, so the device thread
re-acquires it thousands of times per step, each time waiting up to the interpreter's
switch interval when the event loop runs Python without pause. The executor leaves that
process-wide setting alone; the commands that own their process lower it once at start
(`marlaas.cli.process.favour_the_device_thread`, which gives the measurement). Where
they also install turns (`marlaas.device.turns`) and the compute `takes_turns` (native
forwards on a CPU), this thread holds the turn while it runs Python and gives it to the
event loop inside its long native calls and while it waits for work; it lets the loop
keep the turn while it has callbacks ready unless work waits for the device (training
ops queued, or requests the engine has no room for: `RequestGate.saturated`).

Shutdown order (`stop`): set the stop flag and wake the thread -> the thread finishes the
turn in progress and exits -> join it -> fail every op still queued with
`ExecutorClosed`. The compute (engine, trainer) is shut down by its owner after this.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

from marlaas.device.compute import Compute
from marlaas.device.ops import PASSES, Op, PassGathering, Phase, take
from marlaas.device.turns import Turns
from marlaas.device.turns import installed as turns_installed
from marlaas.errors import MarlaasError, TenantNotFound
from marlaas.obs.history import BusyHistory
from marlaas.obs.recorder import NullRecorder, Recorder
from marlaas.train.batch import TrainBatchError
from marlaas.train.records import TrainOutput

#: Longest the turns belong to inference rows at a time (policy step 1).
MAX_INTERACTIVE_S = 4.0


class ExecutorClosed(MarlaasError, RuntimeError):
    """The device executor stopped before this work ran."""


class DeviceExecutor:
    """Runs engine iterations and the port's calls on one thread (see the module doc)."""

    def __init__(self, compute: Compute, recorder: Recorder | None = None) -> None:
        self.compute = compute
        self.recorder: Recorder = recorder or NullRecorder()
        compute.connect(self.wake)
        self._wake = threading.Event()
        self._gathering = PassGathering()
        self._lock = threading.Lock()
        self._ops: list[Op] = []
        self._stopping = False
        self._last_was_pass = False
        #: Policy step 1: when the current inference window ends; what training is owed
        #: before the next one (the waiting passes, one admission of training rows).
        self._window_end: float | None = None
        self._owed_pass = False
        self._owed_fill = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failure: asyncio.Future[BaseException] | None = None
        self._started = 0.0
        self._stopped: float | None = None
        self.busy_decode_s = 0.0
        self.busy_train_s = 0.0
        self.idle_s = 0.0
        self.decode_steps = 0
        self.tokens_sampled = 0
        self.train_passes = 0
        self.forward_passes = 0
        self.pass_tenants = 0
        self.optim_steps = 0
        self.max_pass_tenants = 0
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
        self._fail_pending(ExecutorClosed("the device executor stopped before this ran"))

    @property
    def failure(self) -> asyncio.Future[BaseException]:
        """Resolves with the exception that killed the device thread, if one does."""
        if self._failure is None:
            raise RuntimeError("the device executor is not started")
        return self._failure

    def wake(self) -> None:
        # A set flag is one the device thread has not cleared yet: it clears it before it
        # looks for work, so it will see whatever the caller queued.
        if not self._wake.is_set():
            self._wake.set()

    # -- work ------------------------------------------------------------------------

    def submit(self, op: Op) -> asyncio.Future[Any]:
        """Queue `op`; the returned future (on the calling loop) resolves with its result."""
        with self._lock:
            if self._stopping:
                raise ExecutorClosed("the device executor is stopping; no new work is accepted")
            self._ops.append(op)
        self.wake()
        return asyncio.wrap_future(op.future)

    # -- figures ---------------------------------------------------------------------

    @property
    def busy_s(self) -> float:
        return self.busy_decode_s + self.busy_train_s

    @property
    def elapsed_s(self) -> float:
        end = self._stopped if self._stopped is not None else time.perf_counter()
        return max(end - self._started, 0.0) if self._started else 0.0

    # -- the thread ------------------------------------------------------------------

    def _main(self) -> None:
        turns = turns_installed() if self.compute.takes_turns else None
        if turns is not None and not turns.claim():
            turns = None  # another device thread of this process takes them
        try:
            self._run(turns)
        except BaseException as exc:
            self._signal_failure(exc)
            self._fail_pending(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._stopped = time.perf_counter()
            if turns is not None:
                turns.unclaim()

    def _run(self, turns: Turns | None) -> None:
        compute = self.compute
        away = contextlib.nullcontext() if turns is None else turns.away
        while True:
            self._wake.clear()
            if turns is not None:  # work waits for the device: it goes first (turns doc)
                turns.device_first = bool(self._ops) or compute.gate.saturated()
            with self._lock:
                if self._stopping:
                    return
                ops, self._ops = self._ops, []
            rows_waiting = compute.decodes_here and compute.has_decode_work()
            inference = self._inference_turn(any(op.phase in PASSES for op in ops))
            passes = not inference and not (self._last_was_pass and rows_waiting)
            if passes and self._gathering.hold(ops, rows_waiting=rows_waiting):
                passes = False
            taken, waiting = take(ops, passes=passes)
            with self._lock:
                self._ops[:0] = waiting  # ahead of what came meanwhile: order is kept
            ran_pass = self._turn(taken) if taken else False
            self._last_was_pass = ran_pass
            if ran_pass:
                self._owed_pass = False
                continue
            if compute.decodes_here:
                n = self._decode(training=not inference)
                self._owed_fill = self._owed_fill and inference
                if n > 0:
                    continue
            with self._lock:
                if self._ops or self._stopping:
                    continue
            t0 = time.perf_counter()
            with away:
                self._wake.wait()
            self.idle_s += time.perf_counter() - t0

    def _turn(self, ops: list[Op]) -> bool:
        """Run one turn's ops by phase; returns whether a pass ran."""
        live = [op for op in ops if op.future.set_running_or_notify_cancel()]
        by_phase: dict[Phase, list[Op]] = {phase: [] for phase in Phase}
        for op in live:
            by_phase[op.phase].append(op)
        try:
            for op in by_phase[Phase.ADD]:
                _control(op)
            ran = self._pass(by_phase[Phase.FORWARD_BACKWARD], backward=True)
            ran = self._pass(by_phase[Phase.FORWARD], backward=False) or ran
            self._optim(by_phase[Phase.OPTIM])
            for op in by_phase[Phase.AFTER]:
                _control(op)
        except BaseException as exc:
            self._signal_failure(exc)  # before the callers hear of it: the device's failure
            for op in live:
                if not op.future.done():
                    op.future.set_exception(exc)
            raise
        return ran

    def _pass(self, ops: list[Op], *, backward: bool) -> bool:
        ops = self._known(ops)
        results: dict[str, TrainOutput] = {}
        t0 = time.perf_counter()
        while ops:
            inputs = [inp for op in ops for inp in op.inputs]
            try:
                if backward:
                    results = self.compute.forward_backward(inputs)
                else:
                    results = self.compute.forward(inputs)
                break
            except TrainBatchError as exc:  # that tenant's calls only; retry the rest
                bad = [op for op in ops if exc.tenant in op.tenants]
                if not bad:
                    raise
                for op in bad:
                    op.future.set_exception(exc)
                ops = [op for op in ops if exc.tenant not in op.tenants]
        if not ops:
            return False
        t1 = time.perf_counter()
        tenants = [t for op in ops for t in op.tenants]
        self.busy_train_s += t1 - t0
        self.history.add(t0, t1)
        if backward:
            self._gathering.ran(tenants)
            self.train_passes += 1
            self.pass_tenants += len(tenants)
            self.max_pass_tenants = max(self.max_pass_tenants, len(tenants))
        else:
            self.forward_passes += 1
        rows = sum(len(inp.data) for op in ops for inp in op.inputs)
        name = "train" if backward else "forward"
        self.recorder.span("device", name, t0, t1, args={"tenants": tenants, "rows": rows})
        for op in ops:
            op.future.set_result({t: results[t] for t in op.tenants})
        return True

    def _optim(self, ops: list[Op]) -> None:
        ops = self._known(ops)
        if not ops:
            return
        t0 = time.perf_counter()
        steps = []
        for op in ops:
            assert op.params is not None
            steps.append((op.tenants[0], op.params))
        results = self.compute.optim_step(steps)
        t1 = time.perf_counter()
        self.busy_train_s += t1 - t0
        self.optim_steps += len(ops)
        self.history.add(t0, t1)
        tenants = [t for t, _ in steps]
        # A train step is its pass and its optimizer step: both are "train" spans.
        self.recorder.span("device", "train", t0, t1, args={"tenants": tenants, "optim": True})
        for op in ops:
            op.future.set_result(results[op.tenants[0]])

    def _known(self, ops: list[Op]) -> list[Op]:
        """The ops whose tenants the device holds; the others fail with `TenantNotFound`."""
        kept = []
        for op in ops:
            missing = [t for t in op.tenants if not self.compute.has_tenant(t)]
            if missing:
                op.future.set_exception(
                    TenantNotFound(f"no trainable tenant {missing[0]!r} on the device")
                )
            else:
                kept.append(op)
        return kept

    def _inference_turn(self, passes_waiting: bool) -> bool:
        """Whether this turn belongs to inference rows (policy step 1)."""
        if not (self.compute.decodes_here and self.compute.gate.interactive_active()):
            self._window_end, self._owed_pass, self._owed_fill = None, False, False
            return False
        if self._owed_pass or self._owed_fill:
            return False  # training's turn, between two windows
        now = time.perf_counter()
        if self._window_end is None:
            self._window_end = now + MAX_INTERACTIVE_S
        if now < self._window_end:
            return True
        self._window_end = None
        self._owed_pass, self._owed_fill = passes_waiting, True
        return False

    def _decode(self, *, training: bool = True) -> int:
        t0 = time.perf_counter()
        n, rows = self.compute.decode(training=training)
        t1 = time.perf_counter()
        if rows > 0:  # the engine stepped
            self.busy_decode_s += t1 - t0
        if n > 0:
            self.decode_steps += 1
            self.tokens_sampled += n
            self.history.add(t0, t1)
            self.recorder.span("device", "decode", t0, t1, args={"tokens": n, "rows": rows})
        return n

    def _signal_failure(self, exc: BaseException) -> None:
        """Close the executor and resolve `failure` (callbacks run in order on the loop,
        so the supervisor learns of it before any caller's future fails)."""
        with self._lock:
            self._stopping = True  # nothing may queue work for a dead thread
        loop, failure = self._loop, self._failure
        if loop is not None and failure is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_set_once, failure, exc)

    def _fail_pending(self, exc: BaseException) -> None:
        with self._lock:
            ops, self._ops = self._ops, []
        for op in ops:
            if not op.future.done():
                op.future.set_exception(exc)


def _control(op: Op) -> None:
    """Run a control op; its own error is its caller's."""
    assert op.run is not None
    try:
        result = op.run()
    except Exception as exc:
        op.future.set_exception(exc)
    else:
        op.future.set_result(result)


def _set_once(future: asyncio.Future[BaseException], exc: BaseException) -> None:
    if not future.done():
        future.set_result(exc)
