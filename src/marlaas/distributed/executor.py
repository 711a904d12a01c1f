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
from typing import Any, cast

from marlaas.distributed.engine_client import RayEngineClient
from marlaas.distributed.trainer_client import RayTrainerClient
from marlaas.obs.recorder import Recorder
from marlaas.pipeline.executor import DeviceExecutor
from marlaas.pipeline.scheduler import RequestGate
from marlaas.rollout.engine import RolloutEngine
from marlaas.train.batch import TenantStepResult, TrainBatch
from marlaas.train.grpo import GRPOTrainer


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
        super().__init__(cast(RolloutEngine, engine), cast(GRPOTrainer, trainer), gate, recorder)
        self.ray_engine = engine
        self.ray_trainer = trainer
        gate.on_submit = self.pump
        engine.on_room = self.pump
        self._pump_lock = threading.Lock()
        self._pumping = False
        self._pump_wanted = False
        self._refs: dict[str, Any] = {}  # the last step's adapter refs, by tenant
        self._prompt_tokens = (0, 0)

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
        self._prompt_tokens = (
            sum(s.prefill_tokens for s in stats),
            sum(s.shared_prefill_tokens for s in stats),
        )

    def prompt_tokens(self) -> tuple[int, int]:
        """The replicas' figures, collected at `stop` (zeros before)."""
        return self._prompt_tokens

    @property
    def busy_fraction(self) -> float:
        elapsed = self.elapsed_s
        actors = 1 + len(self.ray_engine.handles)
        return self.busy_s / (elapsed * actors) if elapsed > 0 else 0.0

    # -- where the work runs -----------------------------------------------------------

    decodes_here = False  # the replicas decode; this thread trains and runs calls

    def _trainer_step(self, batches: list[TrainBatch]) -> dict[str, TenantStepResult]:
        results, self._refs = self.ray_trainer.step_refs(batches)
        return results

    def _publish(self, tenant: str, version: int) -> None:
        self.ray_engine.publish_ref(tenant, version, self._refs[tenant])
