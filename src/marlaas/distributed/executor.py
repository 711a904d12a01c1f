"""`RayExecutor`: the device executor of a Ray context.

The same contract as `DeviceExecutor` (`train(batch)` resolves once the new version is
published; `call(fn)` runs trainer calls in order between steps; `failure` resolves
with what killed it; the same shutdown order), with the work split differently: the
rollout replicas decode on their own, so this executor's thread only runs trainer
calls and train steps, and requests move from the `RequestGate` to the replicas
whenever a request is submitted or a replica answers (`pump`), never waiting for a
train step. After a step, each new adapter goes from the trainer to the replicas as an
object ref (the driver never fetches the tensors) and the step's futures resolve only
when every healthy replica holds it.

Figures: `busy_train_s` is the time of train steps and publication; decode figures are
the replicas' own (time inside `engine.step`), collected at `stop`; `busy_fraction` is
the mean busy fraction of the accelerator actors (the trainer and every replica).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future as ThreadFuture
from typing import Any, cast

from marlaas.distributed.engine_client import RayEngineClient
from marlaas.distributed.trainer_client import RayTrainerClient
from marlaas.obs.recorder import Recorder
from marlaas.pipeline.executor import DeviceExecutor
from marlaas.pipeline.scheduler import RequestGate
from marlaas.rollout.engine import RolloutEngine
from marlaas.train.batch import TenantStepResult, TrainBatchError
from marlaas.train.trainer import MultiLaneTrainer


class RayExecutor(DeviceExecutor):
    """Trainer calls and train steps on one thread; requests pumped to the replicas."""

    def __init__(
        self,
        engine: RayEngineClient,
        trainer: RayTrainerClient,
        gate: RequestGate,
        recorder: Recorder | None = None,
    ) -> None:
        # The clients serve the surfaces the base class and the pipeline use.
        super().__init__(
            cast(RolloutEngine, engine), cast(MultiLaneTrainer, trainer), gate, recorder
        )
        self.ray_engine = engine
        self.ray_trainer = trainer
        gate.on_submit = self.pump
        engine.on_room = self.pump
        self._pump_lock = threading.Lock()
        self._pumping = False
        self._pump_wanted = False
        self._replicas_busy_s = 0.0

    def pump(self) -> None:
        """Move fairly-ordered requests into free replica rows. Reentrant and cheap: a
        call made while another thread pumps only asks that one to go round again."""
        with self._pump_lock:
            self._pump_wanted = True
            if self._pumping:
                return
            self._pumping = True
        try:
            while True:
                with self._pump_lock:
                    if not self._pump_wanted:
                        return
                    self._pump_wanted = False
                self.gate.fill()
        finally:
            with self._pump_lock:
                self._pumping = False

    async def stop(self) -> None:
        await super().stop()
        stats = self.ray_engine.replica_stats()
        self.decode_steps = sum(s.decode_steps for s in stats)
        self.tokens_sampled = sum(s.tokens for s in stats)
        self.busy_decode_s = sum(s.busy_s for s in stats)

    @property
    def busy_fraction(self) -> float:
        elapsed = self.elapsed_s
        actors = 1 + len(self.ray_engine.handles)
        return self.busy_s / (elapsed * actors) if elapsed > 0 else 0.0

    # -- the thread ------------------------------------------------------------------

    def _run(self) -> None:
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
            if ready:
                self._train()
                continue
            with self._lock:
                if self._calls or self._jobs or self._stopping:
                    continue
            t0 = time.perf_counter()
            self._wake.wait()
            self.idle_s += time.perf_counter() - t0

    def _step_and_publish(self, jobs: list[Any]) -> dict[str, TenantStepResult]:
        results: dict[str, TenantStepResult] = {}
        refs: dict[str, Any] = {}
        while jobs:
            try:
                results, refs = self.ray_trainer.step_refs([j.batch for j in jobs])
                break
            except TrainBatchError as exc:  # that tenant's batch only; retry the rest
                bad = [j for j in jobs if j.batch.tenant == exc.tenant]
                if not bad:
                    raise
                for j in bad:
                    j.future.set_exception(exc)
                jobs = [j for j in jobs if j.batch.tenant != exc.tenant]
        for j in jobs:
            tenant = j.batch.tenant
            self.ray_engine.publish_ref(tenant, results[tenant].version, refs[tenant])
        return results


def _run_call(fn: Callable[[], Any], future: ThreadFuture[Any]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn()
    except Exception as exc:  # the caller's error, delivered to the caller
        future.set_exception(exc)
    else:
        future.set_result(result)
