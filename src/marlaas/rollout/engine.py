"""The rollout engine: continuous batching of every tenant's sequences over one shared base.

Lifecycle: `RolloutEngine(lora_model, bank, tokenizer, ...)` is ready when constructed.
`await engine.submit(request)` gives the `Completion`; `engine.publish(tenant, version,
tensors)` adds an adapter version; `await engine.close()` ends it. Iterations run either
in the background driver (`background=True`, the default: started by the first
`submit`, or explicitly with `await engine.run_forever()`), or by whoever calls the
synchronous `engine.step()` (e.g. a device executor interleaving decode iterations with
trainer steps). What one iteration does is described in `marlaas.rollout.core`.

What a request gets back (`Completion`):
- `token_ids`: every sampled token, including the EOS token or the token that completed
  a stop string; `logprobs`: `log_softmax(logits / T)` of each (T = temperature, 1.0
  when greedy), before top-k/top-p, aligned with `token_ids`;
- `text`: the decoded new tokens (special tokens skipped), without the EOS, cut before
  the first occurrence of the stop string that ended the row;
- `version`: the adapter version pinned at admission; publishing never changes it.
- Seeded requests (`SamplingParams.seed`) sample the same tokens whatever their batch
  mates; unseeded ones get a seed from the engine's generator (`seed=`).

Streaming: `submit(request, on_token=f)` also calls `f(token_id)` on the submitting loop
for each token as it is sampled, in order, all before the future resolves (the tokens
are exactly `Completion.token_ids`); `enqueue(request, deliver, listener)` is the same in
the stepping thread. The engine only hands the token over (`post` for `submit`): a slow
consumer never slows an iteration, and a listener that raises loses
its stream, never its row nor anyone else's. Front ends that cannot stream (the Ray
client) have `streams_tokens = False`; their callers get every token with the completion.

Threading: `step()` may run in any thread (the driver runs it in a worker thread with
`asyncio.to_thread`, and waits on an `asyncio.Event` when idle: no polling). `submit`,
`enqueue` and `abort` never wait for an iteration; `publish` waits for the iteration in
progress, so a new version lands between two iterations.

Shutdown order (`close`): stop accepting requests -> wake the driver and let the
iteration in progress finish -> fail every queued and running request with
`EngineClosed` and release its adapter pin -> drop the session caches.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase

from marlaas.errors import EngineClosed
from marlaas.model.bank import AdapterBank
from marlaas.model.lora import AdapterTensors, LoRAModel
from marlaas.rollout.batch import Deliver, TokenListener
from marlaas.rollout.core import DecodeScheduler, EngineStats, Pending
from marlaas.rollout.prompts import PromptCache
from marlaas.rollout.sessions import SessionCache
from marlaas.types import Completion, RolloutRequest

#: Default bound on the sessions whose KV is kept (see `RolloutEngine`).
MAX_SESSIONS = 4096


class RolloutEngine:
    """Continuous-batching multi-LoRA generation (see the module docstring).

    `max_batch_size` bounds the running rows, `max_prefill_tokens` the prompt tokens
    admitted per iteration (a longer prompt is admitted alone), `max_sessions` and
    `max_session_tokens` the KV kept for multi-turn sessions, `max_prompts` and
    `max_prompt_tokens` the prefills kept for repeated prompts (`max_prompts=0`: none
    kept; identical prompts admitted together still share one). `eos_token_ids` overrides
    the tokenizer's and the model's EOS ids (`[]`: never stop on EOS).

    The session cache is bounded by its tokens (the memory); its count of entries only
    needs to cover the sessions in flight, whose next turn waits on a tool: many tenants'
    groups at once. At 256 entries, a 32-tenant paper-regime run (`bench paper`) filled
    the count with 21k tokens cached and lost 1,672 of its 2,908 continued turns' caches
    (112k prompt tokens run again); `MAX_SESSIONS` lets the token bound bind instead:
    707 lost, and as many (724) with no bound reached, a turn whose adapter version
    changed since the last one (its cache was computed under the old weights).
    """

    #: Token listeners are called as tokens are sampled ("Streaming" in the module doc).
    streams_tokens = True

    def __init__(
        self,
        model: LoRAModel,
        bank: AdapterBank,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_batch_size: int = 64,
        max_prefill_tokens: int = 4096,
        max_sessions: int = MAX_SESSIONS,
        max_session_tokens: int = 1 << 16,
        max_prompts: int = 512,
        max_prompt_tokens: int = 1 << 15,
        eos_token_ids: Sequence[int] | None = None,
        background: bool = True,
        seed: int | None = None,
    ) -> None:
        self.model = model
        self.bank = bank
        self.tokenizer = tokenizer
        self.background = background
        self._core = DecodeScheduler(
            model,
            bank,
            tokenizer,
            max_batch_size=max_batch_size,
            max_prefill_tokens=max_prefill_tokens,
            sessions=SessionCache(max_sessions, max_session_tokens),
            prompts=PromptCache(max_prompts, max_prompt_tokens),
            eos_token_ids=eos_token_ids,
            seed=seed,
        )
        # `_lock` serialises iterations, publishes and shutdown; `_queue_lock` guards the
        # queue, the abort set and the closing flag, and is never held across model work.
        self._lock = threading.Lock()
        self._queue_lock = threading.Lock()
        self._pending: deque[Pending] = deque()
        self._aborts: set[str] = set()
        self._closing = False
        self._closed = False
        self._driving = False
        self._halt = False
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None

    # -- requests -------------------------------------------------------------------------

    @property
    def stats(self) -> EngineStats:
        """A snapshot of the counters."""
        return replace(self._core.stats)

    @property
    def native_forwards(self) -> bool:
        """Whether its forwards' layers run in one native call each (`rollout.native`)."""
        return self._core.forward.native

    @property
    def running(self) -> int:
        """Rows in the decode batch now."""
        return self._core.batch.size

    @property
    def queued(self) -> int:
        with self._queue_lock:
            return len(self._pending)

    def has_work(self) -> bool:
        with self._queue_lock:
            return bool(self._pending or self._aborts) or self._core.batch.size > 0

    def submit(
        self, request: RolloutRequest, on_token: Callable[[int], None] | None = None
    ) -> asyncio.Future[Completion]:
        """Queue a request; the returned future resolves with its `Completion`.

        Call it from a running event loop. With `background=True` it starts the driver
        task on that loop if none runs. Cancelling the future aborts the request.
        `on_token`, if given, is called on this loop with each token as it is sampled,
        before the future resolves. Raises `EngineClosed` after `close()`.
        """
        loop = asyncio.get_running_loop()
        rid = request.request_id
        future = Withdrawable(loop, lambda: self.abort(rid))

        def deliver(result: Completion | BaseException) -> None:
            post(loop, settle, future, result)

        listener = None if on_token is None else on_loop(loop, on_token)
        self.enqueue(request, deliver, listener)
        # `_driving` is only set once the task runs: several submits in one loop tick
        # must not each start a driver, so the task itself is what we check.
        if self.background and not self._driving and (self._task is None or self._task.done()):
            self._task = loop.create_task(self.run_forever(), name="rollout-engine")
        return future

    def enqueue(
        self, request: RolloutRequest, deliver: Deliver, listener: TokenListener | None = None
    ) -> None:
        """Queue a request; `deliver` is called once, from the thread that steps, with
        the `Completion` or the exception that failed the request. `listener`, if given,
        is called from that thread with each token as it is sampled, before `deliver`;
        it must return at once (hand the token over, never wait)."""
        with self._queue_lock:
            if self._closing:
                raise EngineClosed("the rollout engine is closed; create a new one to submit")
            self._pending.append(Pending(request, deliver, listener))
        self._notify()

    def abort(self, request_id: str) -> None:
        """Stop a queued or running request at the next iteration.

        A running row is answered with its tokens so far (`finish_reason='aborted'`), a
        queued one with `asyncio.CancelledError`.
        """
        with self._queue_lock:
            self._aborts.add(request_id)
        self._notify()

    def publish(
        self, tenant: str, version: int, tensors: AdapterTensors, *, owned: bool = False
    ) -> None:
        """Publish an adapter version to the bank between two iterations (`owned`: as
        `AdapterBank.publish`).

        Running sequences keep the version they were admitted with; requests admitted
        after this returns (with `version=None`) get the new one.
        """
        with self._lock:
            self.bank.publish(tenant, version, tensors, owned=owned)

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Completion]:
        """Serve `requests` by stepping in this thread until all are answered.

        Raises the first failed request's error after all are answered.
        """
        results: dict[int, Completion | BaseException] = {}
        for i, request in enumerate(requests):
            self.enqueue(request, functools.partial(results.__setitem__, i))
        while len(results) < len(requests):
            if self.step() == 0 and not self.has_work() and len(results) < len(requests):
                raise RuntimeError("the rollout engine went idle with requests unanswered")
        answers = [results[i] for i in range(len(requests))]
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
        return [a for a in answers if isinstance(a, Completion)]

    # -- iterations -----------------------------------------------------------------------

    def step(self) -> int:
        """One iteration: admit and prefill, then decode one token on every running row.

        Returns the number of tokens sampled (rows advanced); 0 when idle or closed.
        """
        with self._lock:
            if self._closed:
                return 0
            cancelled: list[Pending] = []
            with self._queue_lock:
                aborts, self._aborts = self._aborts, set()
                if aborts:
                    cancelled = [p for p in self._pending if p.request.request_id in aborts]
                    kept = [p for p in self._pending if p.request.request_id not in aborts]
                    self._pending = deque(kept)
                room = min(self._core.room, len(self._pending))
                candidates = [self._pending.popleft() for _ in range(room)]
            for p in cancelled:
                self._core.stats.aborted += 1
                with contextlib.suppress(Exception):
                    p.deliver(asyncio.CancelledError(f"request {p.request.request_id}"))
            advanced, back = self._core.iterate(candidates, aborts)
            if back:
                with self._queue_lock:
                    self._pending.extendleft(reversed(back))
            return advanced

    async def run_forever(self) -> None:
        """Drive iterations until `close()`: steps run in a worker thread while there is
        work; when idle the driver waits on an event that `enqueue` and `abort` set."""
        if self._driving:
            raise RuntimeError("this rollout engine is already being driven")
        self._driving, self._halt = True, False
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        try:
            while not self._closing:
                self._wake.clear()
                if self.has_work():
                    await asyncio.to_thread(self._run_until_idle)
                else:
                    await self._wake.wait()
        except asyncio.CancelledError:
            self._halt = True  # the worker thread stops after its current iteration
            raise
        except Exception as exc:
            self._fail_everything(exc)
            raise
        finally:
            self._driving = False
            self._wake = None

    async def close(self) -> None:
        """Stop the engine (see the shutdown order in the module docstring)."""
        with self._queue_lock:
            self._closing = True
        self._notify()
        task = self._task
        if task is not None and task is not asyncio.current_task():
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await task
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """The synchronous `close`, for code that steps the engine itself."""
        with self._queue_lock:
            self._closing = True
        self._fail_everything(
            EngineClosed("the rollout engine was closed before this request completed")
        )
        with self._lock:
            self._closed = True
            self._core.sessions.clear()
            self._core.prompts.clear()

    # -- helpers --------------------------------------------------------------------------

    def _run_until_idle(self) -> None:
        while not self._closing and not self._halt and self.has_work():
            self.step()

    def _notify(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the driver's loop is closed
                loop.call_soon_threadsafe(wake.set)

    def _fail_everything(self, exc: BaseException) -> None:
        with self._lock:
            with self._queue_lock:
                pending = list(self._pending)
                self._pending.clear()
                self._aborts.clear()
            for p in pending:
                self._core.fail(p.deliver, exc)
            self._core.fail_all(exc)


class Withdrawable(asyncio.Future[Completion]):
    """A request's future whose cancellation withdraws the request there and then
    (`on_cancel`, on the future's loop). Shared by every engine front end: a done-callback
    would do the same a turn of the loop later, and cost every request that turn when it
    resolves (~9 us of the event loop a request, against ~0.2 without; the loop's time is
    the device thread's too, both need the interpreter lock).

    `on_cancel` is dropped once the future is done: it usually reaches back to the
    future (the gate's waiting item holds both), and a reference cycle per request left
    every finished request, its completion included, to the garbage collector, whose
    youngest-generation collections, holding the interpreter lock, then freed ~40,000
    objects each (70-110 ms, three times in a `bench paper --regime compute` run at 32
    tenants). Done, the future's request is freed as its last reference goes."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_cancel: Callable[[], object]) -> None:
        super().__init__(loop=loop)
        self._on_cancel: Callable[[], object] | None = on_cancel

    def set_result(self, result: Completion) -> None:
        self._on_cancel = None
        super().set_result(result)

    def set_exception(self, exception: type | BaseException) -> None:
        self._on_cancel = None
        super().set_exception(exception)

    def cancel(self, msg: Any | None = None) -> bool:
        if not super().cancel(msg=msg):
            return False
        on_cancel, self._on_cancel = self._on_cancel, None
        if on_cancel is None:
            return True
        try:
            on_cancel()
        except Exception as exc:  # as the loop reports a failing done-callback
            self.get_loop().call_exception_handler(
                {"message": "withdrawing a cancelled request failed", "exception": exc}
            )
        return True


def settle(future: asyncio.Future[Completion], result: Completion | BaseException) -> None:
    """Resolve `future` with a completion or an error, unless its owner cancelled it
    (call on the future's loop). Shared by every engine front end."""
    if future.done():  # cancelled by its owner
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def on_loop(loop: asyncio.AbstractEventLoop, on_token: Callable[[int], None]) -> TokenListener:
    """A listener for the stepping thread that calls `on_token(token)` on `loop` (in
    order, through `post`; never waits). Shared by every engine front end."""

    def listener(token: int) -> None:
        post(loop, on_token, token)

    return listener


class _Mailbox:
    """Calls posted from other threads onto one loop, run there in the order posted."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lock = threading.Lock()
        self.calls: list[tuple[Callable[..., object], tuple[object, ...]]] = []
        self.woken = False

    def drain(self) -> None:
        with self.lock:
            calls, self.calls, self.woken = self.calls, [], False
        for fn, args in calls:
            try:
                fn(*args)
            except Exception as exc:  # as a callback of the loop's own would be reported
                self.loop.call_exception_handler(
                    {"message": f"exception in {fn!r} posted to the loop", "exception": exc}
                )


_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox] = (
    weakref.WeakKeyDictionary()
)
_mailboxes_lock = threading.Lock()


def post(loop: asyncio.AbstractEventLoop, fn: Callable[..., object], *args: object) -> None:
    """Call `fn(*args)` on `loop` from any thread, after everything posted to it before
    (nothing happens if the loop is closed). Calls posted while the loop has not run the
    earlier ones yet share their wake-up: `call_soon_threadsafe` writes to the loop's
    self-pipe each time, a system call and a turn of the interpreter lock for every
    token and completion (28% of the engine's sampling and finishing in a compute-regime
    `bench paper` run, where an iteration completes hundreds of rows)."""
    with _mailboxes_lock:
        box = _mailboxes.get(loop)
        if box is None:
            box = _mailboxes[loop] = _Mailbox(loop)
    with box.lock:
        box.calls.append((fn, args))
        if box.woken:
            return
        box.woken = True
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
        loop.call_soon_threadsafe(box.drain)


class StreamingSubmit(Protocol):
    """A `submit` that can stream: `RolloutEngine.submit`, the request gate's `submit`,
    or anything shaped like them (see "Streaming" in the module docstring). Episodes
    need less: `rollout.episode.Submit`."""

    def __call__(
        self, request: RolloutRequest, on_token: Callable[[int], None] | None = None
    ) -> Awaitable[Completion]: ...
