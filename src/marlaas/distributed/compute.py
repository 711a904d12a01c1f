"""`RayCompute`: the device executor's `Compute` on Ray actors. The device port over it
is the same `ExecutorDevice` as in-process; only where the work runs differs:

| in-process (`LocalCompute`)  | Ray                                                   |
| ---------------------------- | ----------------------------------------------------- |
| `RolloutEngine` + bank       | `RayEngineClient` over `EngineReplica` actors          |
| `MultiLaneTrainer`           | `RayTrainerClient` over a `TrainerWorker` actor        |
| engine stepped by the thread | replicas decode on their own; requests pumped to them |

The executor's thread runs the trainer calls (each blocks on its actor call). Requests
move from the fair-share gate to the replicas whenever a request is submitted or a
replica answers (`pump`), never waiting for a training pass. After an optimizer step,
each new adapter goes from the trainer to the replicas as an object ref (the driver
never fetches the tensors) and the step's results are returned only when every healthy
replica holds it.

Figures: the replicas measure their own decode time, iterations and tokens; the client
collects them when the compute closes (before, they read 0). The accelerators are the
trainer and every replica.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from marlaas.config.specs import LoRASpec
from marlaas.device.compute import EngineFigures, base_spec
from marlaas.device.gate import RequestGate
from marlaas.device.port import BASE
from marlaas.distributed.engine_client import RayEngineClient
from marlaas.distributed.records import ReplicaStats
from marlaas.distributed.trainer_client import RayTrainerClient
from marlaas.errors import ModelError, TenantNotFound
from marlaas.model.lora import AdapterTensors, LoRAModel
from marlaas.train.optim import AdamParams, TenantSnapshot
from marlaas.train.records import OptimResult, TrainInput, TrainOutput


class RayCompute:
    """Trainer calls on the trainer actor; sampling on the replicas (see the module doc)."""

    decodes_here = False
    #: The executor's thread mostly waits on actors here: nothing to take turns over.
    takes_turns = False

    def __init__(
        self, model: LoRAModel, engine: RayEngineClient, trainer: RayTrainerClient
    ) -> None:
        self.model = model  # the driver's weightless copy: shapes and specs only
        self.engine = engine
        self.trainer = trainer
        self._gate = RequestGate(engine, capacity=engine.capacity)
        self._gate.on_submit = self.pump
        engine.on_room = self.pump
        self._pump_lock = threading.Lock()
        self._pumping = False
        self._pump_wanted = False
        self._stats: list[ReplicaStats] = []
        base = base_spec(model)
        engine.register(BASE, base, model.init_adapter(base, 0))

    @property
    def accelerators(self) -> int:
        return 1 + len(self.engine.handles)

    @property
    def gate(self) -> RequestGate:
        return self._gate

    def connect(self, wake: Callable[[], None]) -> None:
        """Nothing to wake: sampling requests are pumped to the replicas, not decoded by
        the executor's thread."""

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
                self._gate.fill()
        finally:
            with self._pump_lock:
                self._pumping = False

    # -- the sampler -----------------------------------------------------------------

    def has_decode_work(self) -> bool:
        return False  # the replicas decode on their own

    def decode(self, *, training: bool = True) -> tuple[int, int]:
        return 0, 0

    def add_adapter(self, name: str, lora: LoRASpec, tensors: AdapterTensors) -> None:
        self.engine.register(name, lora, tensors)

    def drop_adapter(self, name: str) -> None:
        if name in self.engine and name != BASE:
            self.engine.remove(name)

    def has_adapter(self, name: str) -> bool:
        return name in self.engine

    def engine_figures(self) -> EngineFigures:
        stats = self._stats
        return EngineFigures(
            prefill_tokens=sum(s.prefill_tokens for s in stats),
            shared_prefill_tokens=sum(s.shared_prefill_tokens for s in stats),
            rows_running=self.engine.running,
            decode=(
                sum(s.busy_s for s in stats),
                sum(s.decode_steps for s in stats),
                sum(s.tokens for s in stats),
            ),
        )

    # -- trainable tenants -----------------------------------------------------------

    def has_tenant(self, tenant: str) -> bool:
        return tenant in self.trainer

    def add_tenant(
        self, tenant: str, lora: LoRASpec, seed: int, snapshot: TenantSnapshot | None
    ) -> int:
        if tenant in self.engine:
            raise ModelError(f"the name {tenant!r} is in use on the device; drop it first")
        version = self.trainer.add(tenant, lora, seed, snapshot)
        try:
            tensors = snapshot.tensors if snapshot is not None else self.trainer.adapter(tenant)
            self.engine.register(tenant, lora, tensors, version)
        except BaseException:
            self.trainer.remove(tenant)
            raise
        return version

    def restore(self, tenant: str, snapshot: TenantSnapshot) -> int:
        if tenant not in self.trainer:
            raise TenantNotFound(f"no trainable tenant {tenant!r} on the device to restore")
        self.drop_tenant(tenant, keep_adapter=False)
        return self.add_tenant(tenant, snapshot.lora, 0, snapshot)

    def drop_tenant(self, tenant: str, keep_adapter: bool) -> None:
        if tenant not in self.trainer:
            raise TenantNotFound(f"no trainable tenant {tenant!r} on the device")
        self.trainer.remove(tenant)
        self._gate.remove(tenant)
        if not keep_adapter and tenant in self.engine:
            self.engine.remove(tenant)

    def snapshot(self, tenant: str) -> TenantSnapshot:
        return self.trainer.snapshot(tenant)

    def export(self, tenant: str) -> AdapterTensors:
        return self.trainer.adapter(tenant)

    # -- training --------------------------------------------------------------------

    def forward_backward(self, inputs: Sequence[TrainInput]) -> dict[str, TrainOutput]:
        return self.trainer.forward_backward(inputs)

    def forward(self, inputs: Sequence[TrainInput]) -> dict[str, TrainOutput]:
        return self.trainer.forward(inputs)

    def optim_step(self, steps: Sequence[tuple[str, AdamParams]]) -> dict[str, OptimResult]:
        results, refs = self.trainer.optim_step(steps)
        for tenant, result in results.items():
            self.engine.publish_ref(tenant, result.version, refs[tenant])
        return results

    def close(self) -> None:
        """Collect the replicas' figures, then fail what is in flight and kill the
        replicas and the trainer."""
        self._stats = self.engine.replica_stats()
        self.engine.shutdown()
        self.trainer.close()
