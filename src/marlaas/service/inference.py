"""OpenAI-compatible inference behind the service: which models a tenant may call, the
serving adapters registered in the engine's bank, and generation.

Model names (what `model` says in a request, and what `/v1/models` lists):
- `base` -- the plain shared base, no adapter;
- `<job id>` (e.g. `job_3f9a0c1d2e4b5a69`) -- the job's latest adapter: the live one
  while the job trains in the shared engine (the bank tenant named by the job id), else
  its newest checkpoint whose adapter is on disk;
- `<job id>:ckpt-<step>` -- the job's checkpoint at optimizer step `step` (the adapter
  version written at that step).

Invariants:
- A name resolves through the database with the caller's tenant id in the query, so
  another tenant's job is "not found" exactly like a job that never existed.
- A checkpoint's adapter is the PEFT directory at its path under the artifact
  directory, or the `adapter/` directory inside it (a tenant checkpoint); a path that
  leaves the artifact directory is never read.
- Serving adapters live in the bank under `serve:<job id>:<step>` (`serve:base` for the
  base), names no training tenant uses. At most `capacity` of them stay registered; the
  least recently used one without requests in flight is removed first, so a request's
  adapter is never removed under it.

The engine, bank and tokenizer come from an `InferenceProvider`: the pipeline runtime's
shared engine when the service runs one (`ServiceContext.inference`, else a backend
that implements `InferenceSource`), else an engine of the service's own built from
`settings.serve_base_model` on first use (`open_engine`). Heavy imports (torch,
transformers) happen only there, so importing the service stays cheap.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from sqlalchemy import select

from marlaas.config.specs import LoRASpec
from marlaas.errors import CapacityError, EngineClosed, InvalidRequest, TenantNotFound
from marlaas.service.db import Database
from marlaas.service.errors import NotFound, ServiceError
from marlaas.service.models import Checkpoint, Job
from marlaas.types import Completion, RolloutRequest, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from marlaas.model.bank import AdapterBank
    from marlaas.model.lora import LoRAModel
    from marlaas.rollout.engine import RolloutEngine, StreamingSubmit
    from marlaas.service.context import ServiceContext
    from marlaas.service.streaming import ChoiceEvents

log = logging.getLogger(__name__)

BASE_MODEL = "base"
BASE_KEY = "serve:base"
_NAME = re.compile(r"^(?P<job>[A-Za-z0-9_-]{1,32})(?::ckpt-(?P<step>\d{1,9}))?$")
_PEFT_CONFIG = "adapter_config.json"
_CHECKPOINT_ADAPTER = "adapter"


class ModelNotFound(NotFound):
    """The one 404 for a model name: missing, malformed or another tenant's alike."""

    def __init__(self, name: str, hint: str = "") -> None:
        super().__init__(
            f"The model `{name}` does not exist or you do not have access to it. "
            f"{hint or 'List your models with GET /v1/models.'}"
        )
        self.name = name


class BadInferenceRequest(ServiceError, ValueError):
    """A request the model cannot serve as asked; `param` names the field at fault."""

    status_code = 400

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InferenceUnavailable(ServiceError, RuntimeError):
    """The engine cannot take the request now (closed, or every adapter slot pinned)."""

    status_code = 503


class InferenceProvider(Protocol):
    """What serving needs from whoever owns the model (the boundary to the runtime).

    `model`, `bank` and `tokenizer` are the engine's; `submit` queues a request on the
    engine (the runtime passes its fair-share gate's `submit`, the service's own engine
    its `RolloutEngine.submit`) and resolves with the `Completion`; cancelling the
    awaitable aborts the request; `on_token` (streaming) is called on the loop with each
    token as it is sampled, when the engine streams. Serving only ever registers and
    removes `serve:*` tenants in the bank.
    """

    @property
    def model(self) -> LoRAModel: ...

    @property
    def bank(self) -> AdapterBank: ...

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    def submit(
        self, request: RolloutRequest, on_token: Callable[[int], None] | None = None
    ) -> Awaitable[Completion]: ...


@runtime_checkable
class InferenceSource(Protocol):
    """A job backend that shares its engine for inference implements this."""

    def inference_provider(self) -> InferenceProvider | None:
        """The provider over the backend's engine; None while it has none."""
        ...


def provider_of(explicit: InferenceProvider | None, backend: object) -> InferenceProvider | None:
    """The shared provider to serve from: the explicit one, else the backend's."""
    if explicit is not None:
        return explicit
    if isinstance(backend, InferenceSource):
        return backend.inference_provider()
    return None


@dataclass(frozen=True)
class EngineProvider:
    """An `InferenceProvider` from parts: e.g. the runtime's model, bank and tokenizer
    with its request gate's `submit`, or `of_engine` over a background-driven engine."""

    model: LoRAModel
    bank: AdapterBank
    tokenizer: PreTrainedTokenizerBase
    submit: StreamingSubmit

    @classmethod
    def of_engine(cls, engine: RolloutEngine) -> EngineProvider:
        return cls(engine.model, engine.bank, engine.tokenizer, engine.submit)


async def open_engine(
    base_path: Path | None, *, max_rank: int, adapter_slots: int, max_batch_size: int = 32
) -> RolloutEngine:
    """Load a base (None: the embedded one) and build an engine of its own over it,
    driven in the background once the first request comes."""

    def build() -> RolloutEngine:
        from marlaas.model.bank import AdapterBank
        from marlaas.model.base import default_base_path, load_base
        from marlaas.model.lora import LoRAModel
        from marlaas.rollout.engine import RolloutEngine

        base, tokenizer = load_base(base_path or default_base_path())
        model = LoRAModel(base, max_rank=max_rank)
        bank = AdapterBank(model, num_slots=adapter_slots, versions_kept=1)
        return RolloutEngine(model, bank, tokenizer, max_batch_size=max_batch_size)

    return await asyncio.to_thread(build)


# -- model names ----------------------------------------------------------------------


@dataclass(frozen=True)
class ServedModel:
    """A model name resolved for one tenant: the base, a checkpoint's adapter, or (for
    a job's name while the job trains in the shared engine) the job's live adapter."""

    name: str
    created: datetime | None
    job_id: str | None = None
    step: int | None = None
    adapter_dir: Path | None = None
    live: bool = False

    @property
    def key(self) -> str:
        """The adapter's tenant name in the bank."""
        if self.job_id is None:
            return BASE_KEY
        return self.job_id if self.live else f"serve:{self.job_id}:{self.step}"


def adapter_dir(artifact_dir: Path, path: str) -> Path | None:
    """The PEFT directory of a checkpoint row's `path`, or None when it is not on disk."""
    root = artifact_dir.resolve()
    where = (root / path).resolve()
    if not where.is_relative_to(root):
        return None
    for candidate in (where, where / _CHECKPOINT_ADAPTER):
        if (candidate / _PEFT_CONFIG).is_file():
            return candidate
    return None


def _checkpoint_model(name: str, ckpt: Checkpoint, artifact_dir: Path) -> ServedModel | None:
    found = adapter_dir(artifact_dir, ckpt.path)
    if found is None:
        return None
    return ServedModel(name, ckpt.created_at, ckpt.job_id, ckpt.step, found)


def _never(job_id: str) -> bool:
    return False


def resolve_model(
    db: Database,
    tenant_id: str,
    name: str,
    artifact_dir: Path,
    live: Callable[[str], bool] = _never,
) -> ServedModel:
    """The tenant's model called `name` (see the module docstring); `ModelNotFound`
    for anything else. A job's name is its live adapter when `live(job id)` says the
    engine trains it now. Blocking (database and file system)."""
    if name == BASE_MODEL:
        return ServedModel(BASE_MODEL, None)
    match = _NAME.match(name)
    if match is None:
        raise ModelNotFound(name)
    with db.transaction() as session:
        job = session.scalars(
            select(Job).where(
                Job.id == match["job"], Job.tenant_id == tenant_id, Job.deleted_at.is_(None)
            )
        ).one_or_none()
        if job is None:
            raise ModelNotFound(name)
        if match["step"] is None and live(job.id):
            return ServedModel(name, job.updated_at, job.id, live=True)
        query = select(Checkpoint).where(Checkpoint.job_id == job.id)
        if match["step"] is not None:
            query = query.where(Checkpoint.step == int(match["step"]))
        for ckpt in session.scalars(query.order_by(Checkpoint.step.desc())):
            served = _checkpoint_model(name, ckpt, artifact_dir)
            if served is not None:
                return served
    if match["step"] is not None:
        raise ModelNotFound(name, "That job has no checkpoint at this step with its adapter.")
    raise ModelNotFound(name, "That job has no checkpoint with an adapter yet.")


def list_models(
    db: Database, tenant_id: str, artifact_dir: Path, live: Callable[[str], bool] = _never
) -> list[ServedModel]:
    """`base`, then per job of the tenant (oldest first) that has a servable checkpoint
    or trains live: the job's name (its latest adapter) and each checkpoint by step."""
    out = [ServedModel(BASE_MODEL, None)]
    with db.transaction() as session:
        jobs = session.execute(
            select(Job.id, Job.updated_at)
            .where(Job.tenant_id == tenant_id, Job.deleted_at.is_(None))
            .order_by(Job.created_at, Job.id)
        ).all()
        rows = session.execute(
            select(Checkpoint)
            .join(Job, Checkpoint.job_id == Job.id)
            .where(Job.tenant_id == tenant_id, Job.deleted_at.is_(None))
            .order_by(Checkpoint.step)
        ).scalars()
        by_job: dict[str, list[ServedModel]] = {}
        for ckpt in rows:
            served = _checkpoint_model(f"{ckpt.job_id}:ckpt-{ckpt.step}", ckpt, artifact_dir)
            if served is not None:
                by_job.setdefault(ckpt.job_id, []).append(served)
    for job_id, updated in jobs:
        checkpoints = by_job.get(job_id, [])
        if live(job_id):
            out.append(ServedModel(job_id, updated, job_id, live=True))
        elif checkpoints:
            out.append(replace(checkpoints[-1], name=job_id))
        out.extend(checkpoints)
    return out


# -- serving adapters -----------------------------------------------------------------


class AdapterCache:
    """Serving adapters registered in the provider's bank, LRU-bounded (see the module
    docstring). Used from the event loop only; loading runs in a worker thread.

    A request pins its adapter's key before loading starts and unpins it when done, so
    an adapter is only ever removed while no request holds it; when every registered
    adapter is pinned the cache goes over `capacity` until pins are released.
    """

    def __init__(self, provider: InferenceProvider, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.provider = provider
        self.capacity = capacity
        self._registered: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._pins: dict[str, int] = {}
        self._loading: dict[str, asyncio.Future[None]] = {}

    @property
    def registered(self) -> list[str]:
        """Registered adapter keys, least recently used first (the base excluded)."""
        return list(self._registered)

    @asynccontextmanager
    async def use(self, model: ServedModel) -> AsyncIterator[str]:
        """Hold `model`'s adapter registered while the block runs; yields its bank name."""
        if model.job_id is None:
            self._ensure_base()
            yield BASE_KEY
            return
        if model.live or model.adapter_dir is None:  # the training tenant's own adapter
            yield model.key
            return
        key, directory = model.key, model.adapter_dir
        self._pins[key] = self._pins.get(key, 0) + 1
        try:
            if key not in self._registered:
                loading = self._loading.get(key)
                if loading is None:
                    loading = self._loading[key] = asyncio.ensure_future(self._load(key, directory))
                await asyncio.shield(loading)  # raises the load's error; pinned: stays
            self._registered.move_to_end(key)
            yield key
        finally:
            self._pins[key] -= 1
            if self._pins[key] == 0:
                del self._pins[key]
            self._evict()

    def _ensure_base(self) -> None:
        bank = self.provider.bank
        if BASE_KEY not in bank:
            # Rank 0 on one module: the plain base, with the least idle lane compute.
            targets = self.provider.model.target_modules[:1]
            bank.register(BASE_KEY, LoRASpec(rank=0, alpha=1.0, target_modules=targets))

    async def _load(self, key: str, directory: Path) -> None:
        from marlaas.errors import ModelError
        from marlaas.model.peft_io import load_peft

        bank = self.provider.bank
        try:
            if key not in bank:  # else a previous cache over this bank left it: same files
                spec, tensors = await asyncio.to_thread(load_peft, directory, self.provider.model)
                if key not in bank:
                    bank.register(key, spec, tensors)
            self._registered[key] = None
            log.info("serving adapter %s loaded from %s", key, directory)
        except ModelError as e:
            raise BadInferenceRequest(
                f"this checkpoint's adapter cannot be served by this engine: {e}", "model"
            ) from e
        finally:
            del self._loading[key]
        self._evict()

    def _evict(self) -> None:
        while len(self._registered) > self.capacity:
            idle = next((k for k in self._registered if k not in self._pins), None)
            if idle is None:  # every one is in use: trimmed when one is released
                return
            del self._registered[idle]
            with contextlib.suppress(TenantNotFound):  # already gone from the bank
                self.provider.bank.remove(idle)
            log.info("serving adapter %s unloaded (least recently used)", idle)


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
    ) -> list[Completion]:
        """`n` completions of each prompt, prompt-major; choice `j` of a seeded request
        samples with seed `seed + j`, so choices differ and each is reproducible.

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
                )
                for prompt in prompts
                for j in range(n)
            ]
            if events is None:
                futures = [asyncio.ensure_future(self.provider.submit(r)) for r in requests]
            else:
                futures = [
                    asyncio.ensure_future(
                        self.provider.submit(r, functools.partial(events.token, k))
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
    """Whether a shared engine trains a job now (its bank tenant is named by the job
    id); never true on an engine of the service's own, which has only `serve:*`."""
    if provider is None:
        return _never
    bank = provider.bank
    return lambda job_id: job_id in bank


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

    async def server(self) -> InferenceServer:
        async with self._lock:
            settings = self._ctx.settings
            provider = provider_of(self._ctx.inference, self._ctx.backend)
            if provider is None:
                if self._own is None:
                    self._own = await open_engine(
                        settings.serve_base_model,
                        max_rank=settings.max_lora_rank,
                        adapter_slots=settings.max_serving_adapters + 1,
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
