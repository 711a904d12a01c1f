"""OpenAI-compatible inference behind the service: the provider of the engine, and
generation over it (model names are resolved in `service.models_catalog`, serving
adapters are kept registered in `service.serving_adapters`).

Inference is a bounded, fair, cancellable resource:
- bounded per request (`inference_limits.check_request_size`): at most the engine's rows (prompts x n)
  and the tenant's `max_inference_tokens` (prompts x n x max_tokens), else 400 naming
  the parameter and the limit (such a request can never succeed as asked);
- bounded per tenant (`inference_limits.RequestSlots`): at most `max_inference_requests` in flight, else
  429 (it succeeds once one of the tenant's requests ends);
- fair: its rows enter the engine through the device's request gate, which admits
  inference rows ahead of training rows within a share of the engine's rows (see
  `marlaas.device.gate.RequestGate`);
- cancellable: a request whose client disconnects is aborted, streamed or not
  (`inference_limits.unless_disconnected`, and `openai_stream` for streams), and its rows leave the
  engine.

The model, the tokenizer, sampling and serving adapters come from an
`InferenceProvider`: the pipeline's device port when the service runs one
(`DeviceProvider`; `ServiceContext.inference`, else a backend that implements
`InferenceSource`), else, when no backend shares an engine (`marlaas serve --backend
none`), an engine of the service's own built from `settings.serve_base_model` on first
use (`open_engine`, `EngineProvider`). Heavy imports (torch, transformers) happen only
there, so importing the service stays cheap.

Invariant: requests are answered only by the model the service was started for. While
a sharing backend has no engine yet (its pipeline is still loading the base), requests
answer 503 with a `Retry-After` hint; if its pipeline failed to start, 503 with the
reason. Never an engine of the service's own in its place.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

from marlaas.config.specs import LoRASpec, ModelDType
from marlaas.errors import CapacityError, EngineClosed, InvalidRequest, TenantNotFound
from marlaas.service.db import Database
from marlaas.service.errors import ServiceError
from marlaas.service.inference_limits import (
    BadInferenceRequest,
    InferenceQuotas,
    RequestSlots,
    inference_quotas,
)
from marlaas.service.models_catalog import (
    BASE_KEY,
    ServedModel,
    list_models,
    never_live,
    resolve_model,
)
from marlaas.service.serving_adapters import AdapterCache
from marlaas.types import Completion, RolloutRequest, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from marlaas.device.port import DevicePort
    from marlaas.model.bank import AdapterBank
    from marlaas.model.lora import AdapterTensors, LoRAModel
    from marlaas.rollout.engine import RolloutEngine, StreamingSubmit
    from marlaas.service.context import ServiceContext
    from marlaas.service.streaming import ChoiceEvents

log = logging.getLogger(__name__)
T = TypeVar("T")


class InferenceUnavailable(ServiceError, RuntimeError):
    """The engine cannot take the request now (closed, still starting, or every adapter
    slot pinned). `retry_after_s`: when to try again (the `Retry-After` header)."""

    status_code = 503

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    @property
    def headers(self) -> dict[str, str] | None:
        return None if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}


#: Seconds a request that came while the pipeline was starting is told to wait.
STARTING_RETRY_S = 5


class InferenceProvider(Protocol):
    """What serving needs from whoever owns the model (the boundary to the runtime).

    `model` (shapes, for reading PEFT files) and `tokenizer` are the engine's; `sample`
    queues a request (through the device's fair-share gate, or on the service's own
    engine) and resolves with the `Completion`; cancelling the awaitable aborts the
    request; `on_token` (streaming) is called on the loop with each token as it is
    sampled, when the engine streams; `interactive=False` (a training job's judge)
    queues it as training work of its `account` instead of inference. `base_adapter`
    names the plain base. Serving only ever adds and drops `serve:*` adapters.
    """

    @property
    def model(self) -> LoRAModel: ...

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    @property
    def base_adapter(self) -> str: ...

    def sample(
        self,
        request: RolloutRequest,
        on_token: Callable[[int], None] | None = None,
        *,
        interactive: bool = True,
    ) -> Awaitable[Completion]: ...

    def has_adapter(self, name: str) -> bool: ...

    def add_adapter(
        self, name: str, lora: LoRASpec, tensors: AdapterTensors
    ) -> Awaitable[None]: ...

    def drop_adapter(self, name: str) -> Awaitable[None]:
        """Remove a serving adapter (no error if it is gone already)."""
        ...


@runtime_checkable
class InferenceSource(Protocol):
    """A job backend that shares its engine for inference implements this."""

    def inference_provider(self) -> InferenceProvider | None:
        """The provider over the backend's engine; None while it has none."""
        ...


@runtime_checkable
class StartupState(Protocol):
    """A backend whose engine comes from a start that may fail implements this."""

    def start_failure(self) -> BaseException | None:
        """Why the start failed; None while it runs or once it succeeded."""
        ...


def unavailable(backend: object) -> InferenceUnavailable:
    """The answer while a sharing `backend` has no engine: starting, or failed to."""
    failure = backend.start_failure() if isinstance(backend, StartupState) else None
    if failure is not None:
        return InferenceUnavailable(
            f"the job pipeline failed to start, so no model is served: {failure}; fix the "
            "cause (see the server log) and restart the server"
        )
    return InferenceUnavailable(
        "the job pipeline is still starting (loading the base model); retry in a few seconds",
        retry_after_s=STARTING_RETRY_S,
    )


def provider_of(explicit: InferenceProvider | None, backend: object) -> InferenceProvider | None:
    """The shared provider to serve from: the explicit one, else the backend's."""
    if explicit is not None:
        return explicit
    if isinstance(backend, InferenceSource):
        return backend.inference_provider()
    return None


@dataclass(frozen=True)
class DeviceProvider:
    """An `InferenceProvider` over a device port (the pipeline's): sampling through its
    fair-share gate, serving adapters as its frozen adapters, the base as its `BASE`."""

    device: DevicePort

    @property
    def model(self) -> LoRAModel:
        return self.device.model

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.device.tokenizer

    @property
    def base_adapter(self) -> str:
        from marlaas.device.port import BASE

        return BASE

    def sample(
        self,
        request: RolloutRequest,
        on_token: Callable[[int], None] | None = None,
        *,
        interactive: bool = True,
    ) -> Awaitable[Completion]:
        return self.device.sample(request, on_token, interactive=interactive)

    def has_adapter(self, name: str) -> bool:
        return self.device.has_adapter(name)

    def add_adapter(self, name: str, lora: LoRASpec, tensors: AdapterTensors) -> Awaitable[None]:
        return self.device.add_adapter(name, lora, tensors)

    def drop_adapter(self, name: str) -> Awaitable[None]:
        return self.device.drop_adapter(name)


@dataclass(frozen=True)
class EngineProvider:
    """An `InferenceProvider` from an engine's parts: its model, bank and tokenizer
    with a `submit` (`of_engine`: a background-driven engine's own). The base is served
    by a rank-0 adapter registered in the bank as `BASE_KEY` on first use."""

    model: LoRAModel
    bank: AdapterBank
    tokenizer: PreTrainedTokenizerBase
    submit: StreamingSubmit

    @classmethod
    def of_engine(cls, engine: RolloutEngine) -> EngineProvider:
        return cls(engine.model, engine.bank, engine.tokenizer, engine.submit)

    @property
    def base_adapter(self) -> str:
        return BASE_KEY

    def sample(
        self,
        request: RolloutRequest,
        on_token: Callable[[int], None] | None = None,
        *,
        interactive: bool = True,
    ) -> Awaitable[Completion]:
        # No gate on an engine of the service's own: no training shares it.
        if request.tenant == BASE_KEY and BASE_KEY not in self.bank:
            # Rank 0 on one module: the plain base, with the least idle lane compute.
            targets = self.model.target_modules[:1]
            self.bank.register(BASE_KEY, LoRASpec(rank=0, alpha=1.0, target_modules=targets))
        return self.submit(request, on_token)

    def has_adapter(self, name: str) -> bool:
        return name in self.bank

    async def add_adapter(self, name: str, lora: LoRASpec, tensors: AdapterTensors) -> None:
        self.bank.register(name, lora, tensors)

    async def drop_adapter(self, name: str) -> None:
        if name in self.bank:
            self.bank.remove(name)


async def open_engine(
    base_path: Path | None,
    *,
    max_rank: int,
    adapter_slots: int,
    max_batch_size: int = 32,
    device: str = "auto",
    dtype: ModelDType = "auto",
) -> RolloutEngine:
    """Load a base (None: the embedded one) on `device` in `dtype` and build an engine of
    its own over it, driven in the background once the first request comes."""

    def build() -> RolloutEngine:
        from marlaas.device.config import resolve_device
        from marlaas.model.bank import AdapterBank
        from marlaas.model.base import default_base_path, load_base
        from marlaas.model.lora import LoRAModel
        from marlaas.rollout.engine import RolloutEngine

        base, tokenizer = load_base(
            base_path or default_base_path(), dtype=dtype, device=resolve_device(device)
        )
        model = LoRAModel(base, max_rank=max_rank)
        bank = AdapterBank(model, num_slots=adapter_slots, versions_kept=1)
        return RolloutEngine(model, bank, tokenizer, max_batch_size=max_batch_size)

    return await asyncio.to_thread(build)


# -- generation -----------------------------------------------------------------------


class InferenceServer:
    """Serving over one provider: resolution, the adapter cache and generation."""

    def __init__(
        self, provider: InferenceProvider, db: Database, artifact_dir: Path, capacity: int
    ) -> None:
        self.provider = provider
        self.db = db
        self.artifact_dir = artifact_dir
        self.adapters = AdapterCache(provider, capacity)

    async def resolve(self, tenant_id: str, name: str) -> ServedModel:
        live = _live_in(self.provider)
        return await asyncio.to_thread(
            resolve_model, self.db, tenant_id, name, self.artifact_dir, live
        )

    async def generate(
        self,
        model: ServedModel,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        n: int,
        events: ChoiceEvents | None = None,
        *,
        account: str | None = None,
    ) -> list[Completion]:
        """`n` completions of each prompt, prompt-major; choice `j` of a seeded request
        samples with seed `seed + j`, so choices differ and each is reproducible.

        `account`: the pipeline tenant (a job id) whose training work this is (its
        judge): the requests go to the sampler as that job's training rows, on its fair
        share, rather than as inference (see `marlaas.pipeline.judges`).

        With `events` (streaming), choice `k` (prompt-major) reports each token as it is
        sampled (`events.token`) and its completion as soon as it has it
        (`events.done`). Cancelling this call aborts every request it has in flight.
        """
        async with self.adapters.use(model) as key:
            requests = [
                RolloutRequest(
                    tenant=key,
                    prompt_ids=tuple(prompt),
                    sampling=sampling
                    if sampling.seed is None
                    else replace(sampling, seed=sampling.seed + j),
                    account=account,
                )
                for prompt in prompts
                for j in range(n)
            ]
            interactive = account is None
            if events is None:
                futures = [
                    asyncio.ensure_future(self.provider.sample(r, interactive=interactive))
                    for r in requests
                ]
            else:
                futures = [
                    asyncio.ensure_future(
                        self.provider.sample(r, functools.partial(events.token, k))
                    )
                    for k, r in enumerate(requests)
                ]
                for k, future in enumerate(futures):
                    future.add_done_callback(functools.partial(_report, events, k))
            try:
                return list(await asyncio.gather(*futures))
            except InvalidRequest as e:
                raise BadInferenceRequest(_without_request_id(str(e)), "prompt") from e
            except (CapacityError, EngineClosed) as e:
                raise InferenceUnavailable(f"the inference engine cannot serve now: {e}") from e
            except TenantNotFound as e:  # a live job ended between resolving and admission
                raise InferenceUnavailable(
                    f"the adapter of `{model.name}` was just unloaded; retry the request"
                ) from e
            finally:
                for future in futures:  # after a failure: abort the other rows
                    future.cancel()


def _report(events: ChoiceEvents, index: int, future: asyncio.Future[Completion]) -> None:
    if not future.cancelled() and future.exception() is None:
        events.done(index, future.result())


def _live_in(provider: InferenceProvider | None) -> Callable[[str], bool]:
    """Whether a shared engine trains a job now (its adapter is named by the job id);
    never true on an engine of the service's own, which has only `serve:*`."""
    if provider is None:
        return never_live
    return provider.has_adapter


def _without_request_id(message: str) -> str:
    return re.sub(r"^request [^:]+: ", "", message)


class InferenceHub:
    """The app's serving state: the `InferenceServer` over the current provider (the
    context's shared one, else an engine of its own built on first use), closed with
    the app."""

    def __init__(self, ctx: ServiceContext) -> None:
        self._ctx = ctx
        self._lock = asyncio.Lock()
        self._server: InferenceServer | None = None
        self._own: RolloutEngine | None = None
        self.slots = RequestSlots()

    async def quotas(self, tenant_id: str) -> InferenceQuotas:
        return await asyncio.to_thread(inference_quotas, self._ctx.db, tenant_id)

    async def server(self) -> InferenceServer:
        async with self._lock:
            settings = self._ctx.settings
            provider = provider_of(self._ctx.inference, self._ctx.backend)
            if provider is None and isinstance(self._ctx.backend, InferenceSource):
                raise unavailable(self._ctx.backend)  # never another model in its place
            if provider is None:
                if self._own is None:
                    self._own = await open_engine(
                        settings.serve_base_model,
                        max_rank=settings.max_lora_rank,
                        adapter_slots=settings.max_serving_adapters + 1,
                        max_batch_size=settings.max_batch_rows,
                        device=settings.serve_device,
                        dtype=settings.serve_dtype,
                    )
                    log.info("inference: started an engine of its own (no shared engine)")
                provider = EngineProvider.of_engine(self._own)
            if self._server is None or self._server.provider != provider:
                self._server = InferenceServer(
                    provider, self._ctx.db, settings.artifact_dir, settings.max_serving_adapters
                )
            return self._server

    async def models(self, tenant_id: str) -> list[ServedModel]:
        """The tenant's models; listing starts no engine of its own."""
        live = _live_in(provider_of(self._ctx.inference, self._ctx.backend))
        root = self._ctx.settings.artifact_dir
        return await asyncio.to_thread(list_models, self._ctx.db, tenant_id, root, live)

    async def resolve(self, tenant_id: str, name: str) -> ServedModel:
        """One of the tenant's models by name (`ModelNotFound` else); starts no engine."""
        live = _live_in(provider_of(self._ctx.inference, self._ctx.backend))
        root = self._ctx.settings.artifact_dir
        return await asyncio.to_thread(resolve_model, self._ctx.db, tenant_id, name, root, live)

    @property
    def current(self) -> InferenceServer | None:
        """The server built so far (None before the first inference request)."""
        return self._server

    async def close(self) -> None:
        """Stop the engine of its own, if one was started (a shared one is not ours)."""
        async with self._lock:
            own, self._own, self._server = self._own, None, None
        if own is not None:
            await own.close()
