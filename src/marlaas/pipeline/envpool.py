"""The environment stage: env calls (prompts, tool calls, verifiers) off the device.

`EnvPool` runs every environment call of every tenant on the event loop with a bounded
concurrency (a semaphore: a burst of episodes queues here instead of starting thousands
of sandboxes at once) and a per-call timeout. Environment code is async and never blocks
the loop (the `Env` contract): tool latency is awaited, `math` verification runs in its
own thread pool and `python` graders in sandbox subprocesses. So the device thread never
waits for an environment, and the loop never waits for the device.

`play_episode` plays one episode through the engine with a `PooledEnv` and retries it
with a fresh environment when an environment call fails or times out (a retried
environment call could repeat side effects of the first, so the unit of retry is the
episode, never a call). After `retries` failed retries the error is the tenant's
(`TenantFailure`), never anyone else's. Errors of the engine itself (an invalid
request: bad data) are not retried.

Invariant: a timed-out call is cancelled and its semaphore slot is released, so a hung
tool costs its tenant one timeout per attempt and costs other tenants nothing.

Timeouts: every call of a pool has the same timeout, so deadlines come in the order the
calls start, and one loop timer serves them all (`_Deadlines`: armed at the earliest
live deadline), where `asyncio.timeout` would schedule and cancel a timer per call. A
compute-regime `bench paper` run makes ~30,000 environment calls, nearly all finished
without ever suspending, and the event loop's time is the device thread's too (both
need the interpreter lock).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from transformers import PreTrainedTokenizerBase

from marlaas.envs.base import Env, Example, StepResult, TaskFamily
from marlaas.errors import MarlaasError
from marlaas.obs.recorder import NullRecorder, Recorder
from marlaas.pipeline.tenant import TenantFailure
from marlaas.rollout.episode import Submit, run_episode
from marlaas.types import SamplingParams, Trajectory

T = TypeVar("T")


class EnvCallError(MarlaasError, RuntimeError):
    """An environment call raised or timed out; the episode may be retried."""


@dataclass
class EnvPoolStats:
    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    max_concurrent: int = 0


class EnvPool:
    """Bounded-concurrency, time-limited environment calls (see the module docstring)."""

    def __init__(
        self,
        max_concurrency: int = 256,
        timeout_s: float = 120.0,
        recorder: Recorder | None = None,
    ) -> None:
        if max_concurrency < 1 or not timeout_s > 0:
            raise ValueError("max_concurrency must be >= 1 and timeout_s > 0")
        self.max_concurrency = max_concurrency
        self.recorder: Recorder = recorder or NullRecorder()
        self.stats = EnvPoolStats()
        self._slots = asyncio.Semaphore(max_concurrency)
        self._active = 0
        self._deadlines = _Deadlines(timeout_s)

    @property
    def timeout_s(self) -> float:
        """Every call's time limit (its deadlines' one timeout)."""
        return self._deadlines.timeout_s

    #: Whether environments (and so graders) run in this process. A judge of a model
    #: grader calls this process's device, so only such a pool can run one.
    in_process: bool = True

    def place(self, family: TaskFamily) -> TaskFamily:
        """`family` with its environments where this pool runs them: in this process
        here; a distributed backend's pool moves them onto its workers."""
        return family

    @property
    def active(self) -> int:
        """Environment calls in flight now."""
        return self._active

    def close(self) -> None:
        """Release the pool's workers (none here; a distributed pool's actors)."""

    async def call(self, fn: Callable[[], Awaitable[T]], *, tenant: str, what: str) -> T:
        """Await `fn()` within the concurrency bound and the timeout.

        Raises `EnvCallError` (chained to the cause) when it raises or times out.
        """
        async with self._slots:
            self._active += 1
            self.stats.calls += 1
            self.stats.max_concurrent = max(self.stats.max_concurrent, self._active)
            t0 = time.perf_counter()
            try:
                with self._deadlines.enter():
                    return await fn()
            except TimeoutError as exc:
                self.stats.timeouts += 1
                raise EnvCallError(
                    f"environment {what} took longer than {self.timeout_s:g}s (timed out)"
                ) from exc
            except Exception as exc:
                self.stats.errors += 1
                raise EnvCallError(f"environment {what} failed: {exc}") from exc
            finally:
                self._active -= 1
                self.recorder.span("env", what, t0, time.perf_counter(), tenant=tenant)


class _Deadline:
    """One call's deadline: its task, the task's cancellation count at entry, whether
    the timer cancelled it (`expired`) and whether it left (`done`). The call runs
    inside it (`with`): leaving turns the timer's cancellation into `TimeoutError`."""

    __slots__ = ("at", "cancelling", "done", "expired", "owner", "task")

    def __init__(self, owner: _Deadlines, at: float, task: asyncio.Task[object]) -> None:
        self.owner = owner
        self.at = at
        self.task = task
        self.cancelling = task.cancelling()
        self.expired = False
        self.done = False

    def __enter__(self) -> _Deadline:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if self.owner.leave(self) and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc


class _Deadlines:
    """The deadlines of calls that share one timeout (`timeout_s`, fixed here, so that
    the deadlines come in entry order), with one loop timer for all of them (the module
    doc): a call enters, is cancelled by the timer when its deadline passes first, and
    leaves, which turns that cancellation into `TimeoutError` as `asyncio.timeout` does
    (a cancellation from outside stays one)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._queue: deque[_Deadline] = deque()  # in deadline order (= entry order)
        self._timer: asyncio.TimerHandle | None = None
        self._live = 0

    def enter(self) -> _Deadline:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None, "EnvPool.call runs in a task"
        deadline = _Deadline(self, loop.time() + self.timeout_s, task)
        self._queue.append(deadline)
        self._live += 1
        if self._timer is None:
            self._timer = loop.call_at(deadline.at, self._fire, loop)
        return deadline

    def leave(self, deadline: _Deadline) -> bool:
        """The call left; whether the timer's cancellation is what ended it (then the
        task's cancellation count is back to its value at entry)."""
        deadline.done = True
        self._live -= 1
        queue = self._queue
        while queue and queue[0].done:
            queue.popleft()
        if len(queue) > 2 * self._live + 64:  # finished calls behind a long one
            self._queue = deque(d for d in queue if not d.done)
        return deadline.expired and deadline.task.uncancel() <= deadline.cancelling

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        queue, now = self._queue, loop.time()
        while queue and (queue[0].done or queue[0].at <= now):
            deadline = queue.popleft()
            if not deadline.done:
                deadline.expired = True
                deadline.task.cancel()
        if queue:
            self._timer = loop.call_at(queue[0].at, self._fire, loop)


class PooledEnv(Env):
    """An `Env` whose calls go through an `EnvPool`."""

    def __init__(self, env: Env, pool: EnvPool, tenant: str) -> None:
        self.env = env
        self.pool = pool
        self.tenant = tenant
        self.stop = env.stop
        self.max_turns = env.max_turns
        self.tools = env.tools
        self.chat = env.chat

    async def initial_observation(self) -> str:
        return await self.pool.call(
            self.env.initial_observation, tenant=self.tenant, what="initial_observation"
        )

    async def step(self, action: str) -> StepResult:
        return await self.pool.call(lambda: self.env.step(action), tenant=self.tenant, what="step")


async def play_episode(
    *,
    submit: Submit,
    tokenizer: PreTrainedTokenizerBase,
    family: TaskFamily,
    example: Example,
    pool: EnvPool,
    tenant: str,
    sampling: SamplingParams,
    version: int | None = None,
    retries: int = 2,
    on_retry: Callable[[EnvCallError], None] | None = None,
) -> Trajectory:
    """One episode of `example`, retried up to `retries` times on environment errors.

    Each attempt uses a fresh environment and, for seeded sampling, seed + attempt.
    Raises `TenantFailure` when every attempt failed.
    """
    last: EnvCallError | None = None
    for attempt in range(retries + 1):
        env = PooledEnv(family.make_env(example), pool, tenant)
        seed = sampling.seed
        params = (
            sampling if seed is None or attempt == 0 else replace(sampling, seed=seed + attempt)
        )
        try:
            return await run_episode(
                submit,
                tokenizer,
                env,
                tenant=tenant,
                example_id=example.id,
                sampling=params,
                version=version,
            )
        except EnvCallError as exc:
            last = exc
            if attempt < retries and on_retry is not None:
                on_retry(exc)
    assert last is not None
    raise TenantFailure(
        f"episode of example {example.id!r} failed {retries + 1} times; last error: {last}"
    ) from last
