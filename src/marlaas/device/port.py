"""The device port: everything the rest of marlaas may ask of the model compute, and
nothing else. The pipeline, the service's inference and the Tinker-compatible API all
reach the base model, the adapters, the sampler and the trainer only through a
`DevicePort`; whether the device is a thread in this process
(`marlaas.device.inprocess`) or Ray actors (`marlaas.distributed`) is chosen once,
above them (`marlaas.backends`), and never asked again.

Lifecycle
---------
1. Open: an async factory returns a ready, running port (`open_inprocess_device`, or
   the Ray backend's). It serves one base model; `model` and `tokenizer` describe it
   (`model` may hold no weights: read its shapes and specs, never run it).
2. Tenants: `add_tenant` makes a trainable tenant (a LoRA adapter and its AdamW state)
   at version 0 from a seed, or at version k from a `TenantSnapshot`, published to
   the sampler once, at that version. `add_adapter` adds a frozen, sampling-only
   adapter (a checkpoint to serve). `snapshot` / `restore` / `export` read and replace a
   tenant's state; `drop_tenant` / `drop_adapter` remove them. Names are shared by both
   kinds and unique while present; `BASE` is always present and samples the plain base.
3. Work, any mix, from many clients at once:
   - `sample(request)`: one continuation for a tenant or adapter at a version (`None`:
     the newest published when the request is admitted), or for `BASE`. Returns tokens,
     their behaviour log-probs (those the trainer recomputes, so importance ratios are
     exact) and the version used; prompt log-probs when `SamplingParams.prompt_logprobs`
     asks for them (`Completion.prompt_logprobs`, where the engine provides them);
     `on_token` streams tokens as they are sampled where the device can (else they all
     come with the completion). Cancelling the awaitable aborts the request. Requests of
     all tenants share continuous batches; `set_priority` weighs a tenant's share.
   - `forward_backward(inputs)`: for each tenant's `TrainInput` (its data and its own
     objective, `marlaas.train.objectives`), the loss and its gradient. Gradients
     accumulate per tenant, across calls, until `optim_step(tenant, params)` clips them,
     applies one AdamW step with that tenant's `AdamParams`, and publishes the next
     version to the sampler (a request admitted after the step's result arrives samples
     it). `forward(inputs)` is the same pass without gradient (log-probs, loss values).
4. Close: `close()` stops the device: calls still queued fail with `ExecutorClosed`,
   requests in flight with `EngineClosed`. `failure` resolves with the error that
   killed the device, if one does; a caller's own bad input only fails that call.

Ordering and sharing
--------------------
Every method that returns an awaitable queues its work when it is called (not when it
is awaited), so a client may queue `forward_backward` then `optim_step` and await both.
A tenant's calls run in the order they were made. Calls of different tenants that are
pending at the same moment are coalesced: all their `forward_backward` inputs run in one
multi-lane pass over the shared base (one LoRA lane per tenant, each with its own
objective), their `optim_step`s in one batched update. A call is atomic: an input that
cannot be used (`TrainBatchError`, naming the tenant) fails its whole call and changes
nothing; the other calls of that pass run.

Versions: a tenant's version goes up by exactly one per `optim_step`; the sampler keeps
its newest `versions_kept` versions (older ones are dropped once no running request
pins them). `version(tenant)` is the newest published.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, Protocol

from transformers import PreTrainedTokenizerBase

from marlaas.config.specs import LoRASpec
from marlaas.device.records import DeviceFigures
from marlaas.model.lora import AdapterTensors, LoRAModel
from marlaas.obs.history import BusyBucket
from marlaas.train.optim import AdamParams, TenantSnapshot
from marlaas.train.records import OptimResult, TrainInput, TrainOutput
from marlaas.types import Completion, RolloutRequest

#: The name that samples the plain base (no adapter): `RolloutRequest(tenant=BASE, ...)`.
#: Not a valid job name, so no tenant can take it.
BASE: Final = ":base"

#: Called with each token id of a request, in order, as it is sampled.
TokenCallback = Callable[[int], None]


class DevicePort(Protocol):
    """The one boundary to model compute (see the module docstring for the lifecycle)."""

    # -- what it serves ---------------------------------------------------------------

    @property
    def model(self) -> LoRAModel:
        """The base with its LoRA layers, for shapes, target modules and spec checks
        (`max_rank`, `validate_spec`, PEFT I/O). May hold no weights: never run it."""
        ...

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    @property
    def base_name(self) -> str:
        """The base model's name or path, as PEFT files record it."""
        ...

    @property
    def versions_kept(self) -> int:
        """Versions of each tenant the sampler keeps (newest first dropped last)."""
        ...

    @property
    def failure(self) -> asyncio.Future[BaseException]:
        """Resolves with the error that killed the device (then every call fails)."""
        ...

    # -- trainable tenants ------------------------------------------------------------

    def add_tenant(
        self,
        tenant: str,
        lora: LoRASpec,
        *,
        seed: int = 0,
        snapshot: TenantSnapshot | None = None,
    ) -> Awaitable[int]:
        """Add a trainable tenant: a fresh PEFT-style adapter from `seed` at version 0,
        or `snapshot`'s state (adapter, optimizer) at its version. Published to the
        sampler once; resolves with the version. `ModelError` for a name in use or a
        spec the base cannot take."""
        ...

    def drop_tenant(self, tenant: str, *, keep_adapter: bool = False) -> Awaitable[None]:
        """Remove a trainable tenant's training state and cancel its waiting sampling
        requests. `keep_adapter=True` keeps its newest versions sampleable (a finished
        job is still served; `drop_adapter` removes them later)."""
        ...

    def snapshot(self, tenant: str) -> Awaitable[TenantSnapshot]:
        """A detached copy of the tenant's state at its current version (gradients
        accumulated since the last `optim_step` are not part of it)."""
        ...

    def restore(self, snapshot: TenantSnapshot) -> Awaitable[int]:
        """Replace a tenant's whole state by `snapshot` (as `drop_tenant` then
        `add_tenant(snapshot=...)`, in one call; the tenant must exist). Its sampler
        versions restart at the snapshot's; resolves with it."""
        ...

    def export(self, tenant: str) -> Awaitable[AdapterTensors]:
        """The tenant's current adapter: float32 CPU tensors in PEFT layout, for
        `marlaas.model.peft_io.save_peft`."""
        ...

    def version(self, tenant: str) -> int:
        """The tenant's newest published version (`TenantNotFound` if it has none)."""
        ...

    def set_priority(self, tenant: str, weight: float) -> None:
        """The tenant's weight in the sampler's fair share (default 1)."""
        ...

    # -- frozen adapters (sampling only) ----------------------------------------------

    def add_adapter(self, name: str, lora: LoRASpec, tensors: AdapterTensors) -> Awaitable[None]:
        """Add a frozen adapter (e.g. a checkpoint's, for serving) at version 0."""
        ...

    def drop_adapter(self, name: str) -> Awaitable[None]:
        """Remove a frozen adapter or a dropped tenant's kept one (no error if absent);
        requests in flight keep the version they pinned."""
        ...

    def has_adapter(self, name: str) -> bool:
        """Whether `name` can be sampled now (a tenant, a kept or frozen adapter)."""
        ...

    # -- sampling ---------------------------------------------------------------------

    def sample(
        self,
        request: RolloutRequest,
        on_token: TokenCallback | None = None,
        *,
        interactive: bool = False,
    ) -> Awaitable[Completion]:
        """Queue one request; resolves with its `Completion`. Cancel it to abort.
        `interactive`: someone waits for it (an inference endpoint), so it enters the
        sampler ahead of training rows, within bounds (see `marlaas.device.gate`)."""
        ...

    # -- training ---------------------------------------------------------------------

    def forward_backward(self, inputs: Sequence[TrainInput]) -> Awaitable[dict[str, TrainOutput]]:
        """Losses and gradients of each tenant's input (one input per tenant); gradients
        accumulate until the tenant's `optim_step`. Resolves per tenant."""
        ...

    def forward(self, inputs: Sequence[TrainInput]) -> Awaitable[dict[str, TrainOutput]]:
        """The same pass without gradient: losses, sums and (when asked) log-probs."""
        ...

    def optim_step(self, tenant: str, params: AdamParams) -> Awaitable[OptimResult]:
        """Clip the tenant's accumulated gradient, take one AdamW step with `params`,
        clear the gradient and publish the next version (also with no gradient since
        the last step: the moments still move)."""
        ...

    # -- figures and lifecycle --------------------------------------------------------

    def figures(self) -> DeviceFigures:
        """Counters over the device's life (cheap; never waits for the device)."""
        ...

    def busy_timeline(self, window_s: float, bin_s: float) -> list[BusyBucket]:
        """The busy fraction of the device over recent wall-clock bins."""
        ...

    async def close(self) -> None:
        """Stop the device (see the lifecycle); a second call waits for the first."""
        ...


__all__ = ["BASE", "DevicePort", "TokenCallback"]
