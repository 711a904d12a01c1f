"""`ExecutorDevice`: the `DevicePort` over a device executor and its compute.

The in-process device and the Ray one are this class over different `Compute`s
(`LocalCompute` here, `distributed.compute.RayCompute`): the port's ordering,
coalescing and failure rules live once, in the executor (`device.executor`, `device.ops`).

- Calls on tenants' state become ops on the executor's queue at call time; their
  futures resolve on the caller's loop.
- Sampling goes through the compute's fair-share gate (`device.gate`), never through
  the queue: requests do not wait for training.
- Sampling-only adapters run in a worker thread at call time (on Ray they are remote
  calls to every replica), never on the event loop.
- `version(tenant)` is read from a table the device thread updates as each add,
  restore and optimizer step completes, before its result is delivered.

Shutdown order (`close`): stop the executor (it finishes its turn; queued calls fail
with `ExecutorClosed`) -> close the compute (the engine fails what it still holds with
`EngineClosed`; Ray actors are killed).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Future as ThreadFuture
from typing import Any, TypeVar

from transformers import PreTrainedTokenizerBase

from marlaas.config.specs import LoRASpec
from marlaas.device.compute import Compute
from marlaas.device.executor import DeviceExecutor, ExecutorClosed
from marlaas.device.ops import Op, Phase
from marlaas.device.port import BASE, TokenCallback
from marlaas.device.records import DeviceFigures
from marlaas.errors import ConfigError, EngineClosed, TenantNotFound
from marlaas.model.lora import AdapterTensors, LoRAModel
from marlaas.obs.history import BusyBucket
from marlaas.obs.recorder import Recorder
from marlaas.train.optim import AdamParams, TenantSnapshot
from marlaas.train.records import OptimResult, TrainInput, TrainOutput, tenants_of
from marlaas.types import Completion, RolloutRequest

T = TypeVar("T")


class ExecutorDevice:
    """A running device (see the module docstring); build it with `start`."""

    def __init__(
        self,
        compute: Compute,
        executor: DeviceExecutor,
        *,
        model: LoRAModel,
        tokenizer: PreTrainedTokenizerBase,
        base_name: str,
        versions_kept: int,
    ) -> None:
        """Private: use `ExecutorDevice.start`."""
        self.compute = compute
        self.executor = executor
        self._model = model
        self._tokenizer = tokenizer
        self._base_name = base_name
        self._versions_kept = versions_kept
        self._versions: dict[str, int] = {BASE: 0}
        self._closing = False
        self._closed = asyncio.Event()

    @classmethod
    def start(
        cls,
        compute: Compute,
        *,
        model: LoRAModel,
        tokenizer: PreTrainedTokenizerBase,
        base_name: str,
        versions_kept: int,
        recorder: Recorder | None = None,
    ) -> ExecutorDevice:
        """Start the device thread over `compute` (call on the loop that awaits results)."""
        executor = DeviceExecutor(compute, recorder)
        executor.start()
        return cls(
            compute,
            executor,
            model=model,
            tokenizer=tokenizer,
            base_name=base_name,
            versions_kept=versions_kept,
        )

    # -- what it serves ---------------------------------------------------------------

    @property
    def model(self) -> LoRAModel:
        return self._model

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def base_name(self) -> str:
        return self._base_name

    @property
    def versions_kept(self) -> int:
        return self._versions_kept

    @property
    def failure(self) -> asyncio.Future[BaseException]:
        return self.executor.failure

    @property
    def recorder(self) -> Recorder:
        """Where the device's spans go (settable: a long-lived device's runs differ)."""
        return self.executor.recorder

    @recorder.setter
    def recorder(self, recorder: Recorder) -> None:
        self.executor.recorder = recorder

    # -- trainable tenants ------------------------------------------------------------

    def add_tenant(
        self,
        tenant: str,
        lora: LoRASpec,
        *,
        seed: int = 0,
        snapshot: TenantSnapshot | None = None,
    ) -> asyncio.Future[int]:
        self._check_name(tenant)

        def run() -> int:
            return self.compute.add_tenant(tenant, lora, seed, snapshot)

        return self._op(Phase.ADD, (tenant,), run=run, version_of=lambda v: v)

    def drop_tenant(self, tenant: str, *, keep_adapter: bool = False) -> asyncio.Future[None]:
        def run() -> None:
            self.compute.drop_tenant(tenant, keep_adapter)
            if not keep_adapter:
                self._versions.pop(tenant, None)

        return self._op(Phase.AFTER, (tenant,), run=run)

    def snapshot(self, tenant: str) -> asyncio.Future[TenantSnapshot]:
        return self._op(Phase.AFTER, (tenant,), run=lambda: self.compute.snapshot(tenant))

    def restore(self, snapshot: TenantSnapshot) -> asyncio.Future[int]:
        tenant = snapshot.tenant

        def run() -> int:
            return self.compute.restore(tenant, snapshot)

        return self._op(Phase.ADD, (tenant,), run=run, version_of=lambda v: v)

    def export(self, tenant: str) -> asyncio.Future[AdapterTensors]:
        return self._op(Phase.AFTER, (tenant,), run=lambda: self.compute.export(tenant))

    def version(self, tenant: str) -> int:
        version = self._versions.get(tenant)
        if version is None:
            raise TenantNotFound(f"no tenant {tenant!r} on the device")
        return version

    def set_priority(self, tenant: str, weight: float) -> None:
        self.compute.gate.set_weight(tenant, weight)

    # -- frozen adapters --------------------------------------------------------------

    def add_adapter(
        self, name: str, lora: LoRASpec, tensors: AdapterTensors
    ) -> asyncio.Future[None]:
        self._check_name(name)

        def run() -> None:
            self.compute.add_adapter(name, lora, tensors)
            self._versions[name] = 0

        return self._in_thread(run)

    def drop_adapter(self, name: str) -> asyncio.Future[None]:
        if name == BASE:
            raise ConfigError("the base cannot be dropped")

        def run() -> None:
            self.compute.drop_adapter(name)
            if not self.compute.has_tenant(name):
                self._versions.pop(name, None)

        return self._in_thread(run)

    def has_adapter(self, name: str) -> bool:
        return self.compute.has_adapter(name)

    # -- sampling ---------------------------------------------------------------------

    def sample(
        self,
        request: RolloutRequest,
        on_token: TokenCallback | None = None,
        *,
        interactive: bool = False,
    ) -> asyncio.Future[Completion]:
        if self._closing or self.executor.failure.done():
            raise EngineClosed("the device is closed; no new request is accepted")
        return self.compute.gate.submit(request, on_token, interactive=interactive)

    # -- training ---------------------------------------------------------------------

    def forward_backward(
        self, inputs: Sequence[TrainInput]
    ) -> asyncio.Future[dict[str, TrainOutput]]:
        names = tuple(tenants_of(inputs))
        return self._op(Phase.FORWARD_BACKWARD, names, inputs=tuple(inputs))

    def forward(self, inputs: Sequence[TrainInput]) -> asyncio.Future[dict[str, TrainOutput]]:
        names = tuple(tenants_of(inputs))
        return self._op(Phase.FORWARD, names, inputs=tuple(inputs))

    def optim_step(self, tenant: str, params: AdamParams) -> asyncio.Future[OptimResult]:
        return self._op(Phase.OPTIM, (tenant,), params=params, version_of=lambda r: r.version)

    # -- figures and lifecycle --------------------------------------------------------

    def figures(self) -> DeviceFigures:
        ex, engine, gate = self.executor, self.compute.engine_figures(), self.compute.gate
        busy_decode, decode_steps, tokens = ex.busy_decode_s, ex.decode_steps, ex.tokens_sampled
        if engine.decode is not None:  # the replicas decode and measure themselves
            busy_decode, decode_steps, tokens = engine.decode
        busy = busy_decode + ex.busy_train_s
        elapsed = ex.elapsed_s
        return DeviceFigures(
            elapsed_s=elapsed,
            busy_s=busy,
            busy_decode_s=busy_decode,
            busy_train_s=ex.busy_train_s,
            idle_s=ex.idle_s,
            busy_fraction=busy / (elapsed * self.compute.accelerators) if elapsed > 0 else 0.0,
            decode_steps=decode_steps,
            tokens_sampled=tokens,
            train_passes=ex.train_passes,
            pass_tenants=ex.pass_tenants,
            max_pass_tenants=ex.max_pass_tenants,
            forward_passes=ex.forward_passes,
            optim_steps=ex.optim_steps,
            prefill_tokens=engine.prefill_tokens,
            shared_prefill_tokens=engine.shared_prefill_tokens,
            rows_running=engine.rows_running,
            tokens_by_tenant=dict(gate.tokens),
            waiting_by_tenant=gate.waiting(),
        )

    def busy_timeline(self, window_s: float, bin_s: float) -> list[BusyBucket]:
        return self.executor.history.timeline(window_s, bin_s)

    async def close(self) -> None:
        if self._closing:
            await self._closed.wait()
            return
        self._closing = True
        try:
            await self.executor.stop()
        finally:
            await asyncio.to_thread(self.compute.close)
            self._closed.set()

    # -- helpers ----------------------------------------------------------------------

    def _check_name(self, name: str) -> None:
        if name == BASE:
            raise ConfigError(f"{BASE!r} names the plain base; choose another name")

    def _op(
        self,
        phase: Phase,
        tenants: tuple[str, ...],
        *,
        run: Callable[[], Any] | None = None,
        inputs: tuple[TrainInput, ...] = (),
        params: AdamParams | None = None,
        version_of: Callable[[Any], int] | None = None,
    ) -> asyncio.Future[Any]:
        future: ThreadFuture[Any] = ThreadFuture()
        if version_of is not None:
            # Registered before the loop's wrapper, so it runs first, in the device
            # thread: the new version is readable before anyone sees the result.
            tenant = tenants[0]

            def record(f: ThreadFuture[Any]) -> None:
                if not f.cancelled() and f.exception() is None:
                    self._versions[tenant] = version_of(f.result())

            future.add_done_callback(record)
        op = Op(phase, tenants, future, run=run, inputs=inputs, params=params)
        return self.executor.submit(op)

    def _in_thread(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        if self._closing:
            raise ExecutorClosed("the device is closed")
        return asyncio.get_running_loop().run_in_executor(None, fn)
