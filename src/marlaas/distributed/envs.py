"""`RayEnvPool`: the environment pool of a Ray context, with episodes on env workers.

`EnvPool.call` (bounded concurrency, per-call timeout, errors as `EnvCallError`) is
unchanged; what changes is where the environment runs. `place(family)` wraps a task
family so that its environments are `RemoteEnv`s: the real `Env` is created by
`family.make_env(example)` on an environment worker actor and lives there from
`initial_observation` to its last `step`; the episode's calls go to that worker.
The family is put in the object store once and fetched once per worker.

Faults: a worker that dies (`RayActorError`) or restarted meanwhile (`EpisodeLost`)
fails the calls of the episodes it held. They surface as `EnvCallError`, so
`play_episode` retries each such episode from the start with a fresh environment, on a
worker Ray has restarted or another one (the unit of retry is the episode, never a
call: a repeated call could repeat its side effects). A timed-out call is cancelled on
the worker too.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import ray
from ray.exceptions import RayActorError, RayTaskError

from marlaas.distributed.records import DEAD_AFTER_FAILURES, EpisodeLost, unwrap
from marlaas.envs.base import Env, Example, StepResult, TaskFamily
from marlaas.errors import MarlaasError
from marlaas.obs.recorder import Recorder
from marlaas.pipeline.envpool import EnvPool


class EnvWorkerLost(MarlaasError, RuntimeError):
    """The environment worker running this episode died or restarted."""


class RayEnvPool(EnvPool):
    """Environment calls, bounded and timed as in-process, run on worker actors."""

    in_process = False

    def __init__(
        self,
        workers: Sequence[Any],
        max_concurrency: int = 256,
        timeout_s: float = 120.0,
        recorder: Recorder | None = None,
    ) -> None:
        if not workers:
            raise ValueError("a Ray environment pool needs at least one worker")
        super().__init__(max_concurrency, timeout_s, recorder)
        self.workers = list(workers)
        self._load = [0] * len(self.workers)
        self._down: set[int] = set()
        self._load_lock = threading.Lock()
        self.workers_lost = 0

    def place(self, family: TaskFamily) -> TaskFamily:
        """`family` with its environments on the workers (idempotent)."""
        if isinstance(family, RemoteFamilyMixin):
            return family
        return remote_family(family, self)

    def acquire(self) -> int:
        """The least loaded worker that is up (any, if none is), counted busy until
        `release`."""
        with self._load_lock:
            up = [i for i in range(len(self.workers)) if i not in self._down]
            index = min(up or range(len(self.workers)), key=lambda i: (self._load[i], i))
            self._load[index] += 1
            return index

    def mark_down(self, index: int) -> None:
        """Avoid worker `index` until it answers again (Ray is restarting it)."""
        with self._load_lock:
            if index in self._down:
                return
            self._down.add(index)
            self.workers_lost += 1
        threading.Thread(
            target=self._wait_up, args=(index,), name=f"marlaas-env-{index}", daemon=True
        ).start()

    def _wait_up(self, index: int) -> None:
        # A call to an actor being restarted waits for it; one out of restarts fails
        # at once, every time: then it stays down.
        for _ in range(DEAD_AFTER_FAILURES):
            try:
                ray.get(self.workers[index].info.remote())
            except RayActorError:
                time.sleep(0.2)  # the death may not have reached Ray's GCS yet
                continue
            with self._load_lock:
                self._down.discard(index)
            return

    def release(self, index: int) -> None:
        with self._load_lock:
            self._load[index] -= 1

    def close(self) -> None:
        for worker in self.workers:
            with contextlib.suppress(Exception):
                ray.kill(worker, no_restart=True)


@dataclass(frozen=True)
class Placement:
    """Where a placed family's environments run: the pool, the local family, and its
    object ref under a key (fetched once per worker)."""

    pool: RayEnvPool
    local: TaskFamily
    key: str
    ref: Any


class RemoteFamilyMixin:
    """What `place` adds to a family: `make_env` gives `RemoteEnv`s. The placed family is
    a shallow copy of the local one whose class (made for it) also derives from the
    local class, so the pipeline's `isinstance` checks and the family's own attributes
    still hold; the placement is a class attribute, so slotted families work too."""

    __slots__ = ()
    placement: ClassVar[Placement]


def _remote_make_env(self: RemoteFamilyMixin, example: Example) -> Env:
    return RemoteEnv(self.placement, example)


def remote_family(local: TaskFamily, pool: RayEnvPool) -> TaskFamily:
    """`local`, with its environments on `pool`'s workers (see `RemoteFamilyMixin`)."""
    cls = type(local)
    placement = Placement(pool, local, uuid.uuid4().hex, ray.put(local))
    sub = type(
        f"Remote{cls.__name__}",
        (cls, RemoteFamilyMixin),  # the mixin last: the family's own layout comes first
        {
            "__slots__": (),
            "__module__": __name__,
            "placement": placement,
            "make_env": _remote_make_env,
        },
    )
    placed = copy.copy(local)
    placed.__class__ = sub
    return placed


class RemoteEnv(Env):
    """One episode whose `Env` lives on an environment worker (see the module docstring)."""

    def __init__(self, placement: Placement, example: Example) -> None:
        self.placement = placement
        self.example = example
        probe = placement.local.make_env(example)  # the episode's static knobs, read here
        self.stop = tuple(probe.stop)
        self.max_turns = probe.max_turns
        self.tools = tuple(probe.tools)
        self.chat = probe.chat
        # Random: unique across driver processes without a shared counter.
        self.episode_id = f"{placement.key[:8]}-{uuid.uuid4().hex[:16]}"
        self._worker: int | None = None
        self._release: weakref.finalize[Any, Any] | None = None

    async def initial_observation(self) -> str:
        """Start the episode on a worker. Nothing of the episode has happened before
        this returns, so a worker lost here is replaced by another at once."""
        pool = self.placement.pool
        for attempt in range(len(pool.workers) + 1):
            index = pool.acquire()
            self._worker = index
            # An abandoned episode (its task cancelled) gives its worker back when
            # collected.
            self._release = weakref.finalize(self, pool.release, index)
            ref = pool.workers[index].start.remote(
                self.placement.key, [self.placement.ref], self.example, self.episode_id
            )
            try:
                observation: str = await self._await(ref)
            except EnvWorkerLost:
                self._done()
                if attempt == len(pool.workers):
                    raise
                continue
            except BaseException:
                self._done()
                raise
            return observation
        raise AssertionError("unreachable")

    async def step(self, action: str) -> StepResult:
        if self._worker is None:
            raise RuntimeError("step() before initial_observation(): the Env lifecycle")
        ref = self.placement.pool.workers[self._worker].step.remote(self.episode_id, action)
        try:
            result: StepResult = await self._await(ref)
        except BaseException:
            self._done()
            raise
        if result.done:
            self._done()
        return result

    async def _await(self, ref: Any) -> Any:
        try:
            return await ref
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                ray.cancel(ref)
            raise
        except RayActorError as exc:
            self._lost()
            raise EnvWorkerLost(f"environment worker {self._worker} died: {exc}") from None
        except RayTaskError as exc:
            cause = unwrap(exc)
            if isinstance(cause, EpisodeLost):
                self._lost()
                raise EnvWorkerLost(str(cause)) from None
            raise cause from None

    def _lost(self) -> None:
        if self._worker is not None:
            self.placement.pool.mark_down(self._worker)

    def _done(self) -> None:
        if self._release is not None:
            self._release()  # runs pool.release once, whoever calls first
        self._worker = None
