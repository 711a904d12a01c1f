"""Where the model compute runs, as the device executor drives it: the `Compute`
protocol, and `LocalCompute`, the engine, adapter bank and trainer of this process.

The executor (`device.executor`) owns ordering, coalescing and failure handling; a
`Compute` only does each thing when told, from the executor's thread: train passes,
optimizer steps (each new version published to the sampler before it returns), tenant
changes, and, where it `decodes_here`, one engine iteration at a time. The Ray backend
has its own (`marlaas.distributed.compute`), whose replicas decode on their own.

Sampling-only adapters (`add_adapter`, `drop_adapter`, `has_adapter`) touch only the
sampler and may be called from any thread (the bank takes its own lock).

Invariants of `LocalCompute`: a trainable tenant is in the trainer and the bank at the
same version (registered in both with the same tensors, and every optimizer step
publishes before it returns); the base is registered once, as `BASE`, a rank-0 adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from marlaas.config.specs import LoRASpec
from marlaas.device.gate import RequestGate
from marlaas.device.port import BASE
from marlaas.errors import ModelError
from marlaas.model.bank import AdapterBank
from marlaas.model.lora import AdapterTensors, LoRAModel
from marlaas.rollout.engine import RolloutEngine
from marlaas.train.optim import AdamParams, TenantSnapshot
from marlaas.train.records import OptimResult, TrainInput, TrainOutput
from marlaas.train.trainer import MultiLaneTrainer


@dataclass(frozen=True)
class EngineFigures:
    """The sampler's own counters. `decode` is (busy s, iterations, tokens) where the
    engine runs elsewhere and measures itself; None where the executor steps it."""

    prefill_tokens: int
    shared_prefill_tokens: int
    rows_running: int
    decode: tuple[float, int, int] | None = None


class Compute(Protocol):
    """What the device executor drives (see the module docstring)."""

    @property
    def decodes_here(self) -> bool:
        """Whether the executor's thread steps the engine (`decode`)."""
        ...

    @property
    def accelerators(self) -> int:
        """Accelerator processes busy time is shared by (1 here; more on Ray)."""
        ...

    @property
    def gate(self) -> RequestGate: ...

    @property
    def takes_turns(self) -> bool:
        """Whether the executor's thread leaves Python in long native calls for most of
        its compute, so that taking turns with the event loop pays (`device.turns`)."""
        ...

    def connect(self, wake: Callable[[], None]) -> None:
        """`wake` wakes the executor's thread (a sampling request came)."""
        ...

    def has_decode_work(self) -> bool: ...

    def decode(self, *, training: bool = True) -> tuple[int, int]:
        """One engine iteration: (tokens sampled, rows run); `training=False` admits
        inference rows only (an inference window, see `device.executor`)."""
        ...

    def has_tenant(self, tenant: str) -> bool: ...

    def add_tenant(
        self, tenant: str, lora: LoRASpec, seed: int, snapshot: TenantSnapshot | None
    ) -> int: ...

    def restore(self, tenant: str, snapshot: TenantSnapshot) -> int: ...

    def drop_tenant(self, tenant: str, keep_adapter: bool) -> None: ...

    def snapshot(self, tenant: str) -> TenantSnapshot: ...

    def export(self, tenant: str) -> AdapterTensors: ...

    def forward_backward(self, inputs: Sequence[TrainInput]) -> dict[str, TrainOutput]: ...

    def forward(self, inputs: Sequence[TrainInput]) -> dict[str, TrainOutput]: ...

    def optim_step(self, steps: Sequence[tuple[str, AdamParams]]) -> dict[str, OptimResult]: ...

    def add_adapter(self, name: str, lora: LoRASpec, tensors: AdapterTensors) -> None: ...

    def drop_adapter(self, name: str) -> None: ...

    def has_adapter(self, name: str) -> bool: ...

    def engine_figures(self) -> EngineFigures: ...

    def close(self) -> None:
        """Shut the sampler and the trainer down (after the executor has stopped)."""
        ...


def base_spec(model: LoRAModel) -> LoRASpec:
    """The rank-0 adapter that samples the plain base (one module: the least idle lane
    compute)."""
    return LoRASpec(rank=0, alpha=1.0, target_modules=model.target_modules[:1])


class LocalCompute:
    """The engine, bank and trainer of this process, on one shared base."""

    decodes_here = True
    accelerators = 1

    def __init__(
        self,
        model: LoRAModel,
        bank: AdapterBank,
        engine: RolloutEngine,
        trainer: MultiLaneTrainer,
        gate: RequestGate,
    ) -> None:
        self.model = model
        self.bank = bank
        self.engine = engine
        self.trainer = trainer
        self._gate = gate
        bank.register(BASE, base_spec(model))

    @property
    def gate(self) -> RequestGate:
        return self._gate

    @property
    def takes_turns(self) -> bool:
        """Where the engine's forwards run their layers in one native call (a CPU with
        the native kernels, a base they cover)."""
        return self.engine.native_forwards

    def connect(self, wake: Callable[[], None]) -> None:
        self._gate.on_submit = wake

    # -- the sampler -----------------------------------------------------------------

    def has_decode_work(self) -> bool:
        return self.engine.has_work() or self._gate.has_waiting()

    def decode(self, *, training: bool = True) -> tuple[int, int]:
        self._gate.fill(training=training)
        if not self.engine.has_work():
            return 0, 0
        rows = self.engine.running
        return self.engine.step(), rows

    def add_adapter(self, name: str, lora: LoRASpec, tensors: AdapterTensors) -> None:
        self.bank.register(name, lora, tensors=tensors)

    def drop_adapter(self, name: str) -> None:
        if name in self.bank and name != BASE:
            self.bank.remove(name)

    def has_adapter(self, name: str) -> bool:
        return name in self.bank

    def engine_figures(self) -> EngineFigures:
        stats = self.engine.stats
        return EngineFigures(stats.prefill_tokens, stats.shared_prefill_tokens, self.engine.running)

    # -- trainable tenants -----------------------------------------------------------

    def has_tenant(self, tenant: str) -> bool:
        return tenant in self.trainer

    def add_tenant(
        self, tenant: str, lora: LoRASpec, seed: int, snapshot: TenantSnapshot | None
    ) -> int:
        if tenant in self.bank:
            raise ModelError(f"the name {tenant!r} is in use on the device; drop it first")
        version = self.trainer.add(tenant, lora, seed=seed, snapshot=snapshot)
        try:
            self.bank.register(tenant, lora, self.trainer.adapter(tenant), version=version)
        except BaseException:
            self.trainer.remove(tenant)
            raise
        return version

    def restore(self, tenant: str, snapshot: TenantSnapshot) -> int:
        self.trainer.version(tenant)  # TenantNotFound: restore replaces a tenant
        self.drop_tenant(tenant, keep_adapter=False)
        return self.add_tenant(tenant, snapshot.lora, 0, snapshot)

    def drop_tenant(self, tenant: str, keep_adapter: bool) -> None:
        self.trainer.remove(tenant)
        self._gate.remove(tenant)
        if not keep_adapter and tenant in self.bank:
            self.bank.remove(tenant)

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
        results = self.trainer.optim_step(steps)
        for tenant, result in results.items():
            self.engine.publish(tenant, result.version, self.trainer.adapter(tenant), owned=True)
        return results

    def close(self) -> None:
        self.engine.shutdown()
