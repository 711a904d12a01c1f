"""The Tinker-compatible API's state in one app: the device it trains and samples on,
futures, sessions, live training runs, samplers and the database store.

The device: the job backend's own (`DeviceSource.shared_device`, e.g. the pipeline's
in-process or Ray device, so Tinker runs and jobs share passes and batches), else one
of the hub's own, opened on first use over `settings.serve_base_model` (the embedded
base by default) and closed with the app.

A training run is a trainable tenant of the device, named `tinker:<model id>`; a
sampler's adapter a frozen one (`samplers`). Both belong to one marlaas tenant (the
owner of the key that made them) and are looked up with the owner's id, so another
tenant's ids answer 404 like missing ones.

Lifecycle: `start` (runs the database left active are marked closed: a new device
holds none; expired checkpoints are removed), then requests; a reaper finishes
sessions without heartbeats and takes their runs off the device; `close` stops the
reaper and closes the hub's own device (a shared one belongs to the backend).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from marlaas.config.specs import LoRASpec
from marlaas.device.port import DevicePort
from marlaas.service.db import Database
from marlaas.service.tinker.convert import ModelLimits
from marlaas.service.tinker.errors import NotLoaded, UserError, not_found
from marlaas.service.tinker.futures import DEFAULT_POLL_S, FutureStore
from marlaas.service.tinker.samplers import Sampler, SamplerAdapters
from marlaas.service.tinker.sequence import ModelSequence
from marlaas.service.tinker.sessions import DEFAULT_TIMEOUT_S, Session, Sessions
from marlaas.service.tinker.store import TinkerStore
from marlaas.service.tinker.wire import UntypedFuture

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TinkerSettings:
    """`poll_s`: a retrieval's long-poll; `session_timeout_s`: a session without
    heartbeats ends after this; `sampler_adapters`: frozen sampler adapters kept on the
    device; `max_num_samples`: samples one `asample` may ask for; `ephemeral_samplers`:
    in-memory samplers a run keeps (its newest)."""

    poll_s: float = DEFAULT_POLL_S
    session_timeout_s: float = DEFAULT_TIMEOUT_S
    sampler_adapters: int = 32
    max_num_samples: int = 256
    #: Ephemeral samplers (`save_weights_and_get_sampling_client`) kept per run.
    ephemeral_samplers: int = 16
    reap_every_s: float = 30.0


@dataclass(frozen=True)
class SharedDevice:
    """A device a job backend shares, and the base it serves (its directory: what
    Tinker clients name it by)."""

    port: DevicePort
    base_model: str


@runtime_checkable
class DeviceSource(Protocol):
    """A job backend whose device the Tinker API may use implements this."""

    async def shared_device(self) -> SharedDevice | None:
        """The device, once it runs (waits for it to start); None when it has none."""
        ...


#: Opens the hub's device on first use; returns it and whether the hub owns it (then
#: the hub closes it).
OpenDevice = Callable[[], Awaitable[tuple[SharedDevice, bool]]]


@dataclass
class LiveRun:
    """A training run on the device."""

    id: str
    owner: str
    session_id: str
    base_model: str
    lora: LoRASpec
    sequence: ModelSequence
    #: The run's trainable tenant on the device.
    device_name: str = field(init=False)

    def __post_init__(self) -> None:
        self.device_name = f"tinker:{self.id}"


@dataclass
class Counters:
    """What the API did, for `/metrics` (per marlaas tenant id)."""

    requests: dict[tuple[str, str], int] = field(default_factory=dict)
    train_tokens: dict[str, int] = field(default_factory=dict)
    sampled_tokens: dict[str, int] = field(default_factory=dict)
    forward_backward_calls: int = 0

    def count(self, owner: str, kind: str) -> None:
        self.requests[(owner, kind)] = self.requests.get((owner, kind), 0) + 1

    @staticmethod
    def add(table: dict[str, int], owner: str, n: int) -> None:
        table[owner] = table.get(owner, 0) + n


class TinkerHub:
    """See the module docstring. Event-loop only."""

    def __init__(
        self,
        db: Database,
        artifact_dir: Path,
        open_device: OpenDevice,
        settings: TinkerSettings | None = None,
    ) -> None:
        self.settings = settings or TinkerSettings()
        self.store = TinkerStore(db, artifact_dir)
        self.futures = FutureStore(poll_s=self.settings.poll_s)
        self.sessions = Sessions(self.settings.session_timeout_s)
        self.runs: dict[str, LiveRun] = {}
        self.samplers: dict[str, Sampler] = {}
        #: (sampler id, seq_id) -> the answer of that `asample` (resends get it again).
        self.sample_calls: OrderedDict[tuple[str, int], UntypedFuture] = OrderedDict()
        #: run id -> its ephemeral samplers' ids, oldest first.
        self.ephemeral: dict[str, deque[str]] = {}
        #: request id -> the task serving a sample (`cancel_future` cancels it).
        self.sample_tasks: dict[str, asyncio.Task[None]] = {}
        self.counters = Counters()
        self.tasks: set[asyncio.Task[None]] = set()
        self._open_device = open_device
        self._device: SharedDevice | None = None
        self._owns_device = False
        self._adapters: SamplerAdapters | None = None
        self._device_lock = asyncio.Lock()
        self._reaper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        closed = await asyncio.to_thread(self.store.close_all)
        purged = await asyncio.to_thread(self.store.purge_expired)
        if closed or purged:
            log.info(
                "tinker: %d run(s) marked closed, %d expired checkpoint(s) removed", closed, purged
            )
        self._reaper = asyncio.create_task(self._reap(), name="tinker-session-reaper")

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        async with self._device_lock:
            device, self._device = self._device, None
        if device is not None and self._owns_device:
            await device.port.close()

    # -- the device -------------------------------------------------------------------

    async def device(self) -> SharedDevice:
        async with self._device_lock:
            if self._device is None:
                self._device, self._owns_device = await self._open_device()
                self._adapters = SamplerAdapters(self._device.port, self.settings.sampler_adapters)
            return self._device

    async def adapters(self) -> SamplerAdapters:
        await self.device()
        assert self._adapters is not None
        return self._adapters

    @property
    def device_if_open(self) -> SharedDevice | None:
        return self._device

    async def limits(self) -> ModelLimits:
        config = (await self.device()).port.model.base.config
        return ModelLimits(
            vocab_size=int(config.vocab_size), max_positions=int(config.max_position_embeddings)
        )

    async def base_model(self, name: str | None) -> str:
        """The served base's name for `name` (its directory, or that directory's last
        part); `UserError` naming the base otherwise."""
        served = (await self.device()).base_model
        if name is None or name in (served, Path(served).name):
            return served
        raise UserError(
            f"base model {name!r} is not served here; this server trains and samples "
            f"{served!r} (list it with RestClient().get_server_capabilities())"
        )

    # -- runs and samplers ------------------------------------------------------------

    def spawn(self, work: Awaitable[None], name: str) -> asyncio.Task[None]:
        """Run `work` in a task the hub owns (cancelled at close); it handles its errors."""

        async def run() -> None:
            await work

        task = asyncio.create_task(run(), name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def live_run(self, owner: str, model_id: str) -> LiveRun:
        """The owner's run on the device: 404 if it is not the owner's, `NotLoaded` if it
        exists but is not on the device."""
        run = self.runs.get(model_id)
        if run is not None and run.owner == owner:
            return run
        await asyncio.to_thread(self.store.run, owner, model_id)  # 404 for a foreign id
        raise NotLoaded(
            f"training run {model_id!r} is not loaded (its session finished or the server "
            "restarted); create a new training client from one of its saved states "
            "(ServiceClient.create_training_client_from_state)"
        )

    def sampler(self, owner: str, sampler_id: str) -> Sampler:
        found = self.samplers.get(sampler_id)
        if found is None or found.owner != owner:
            raise not_found("sampler", sampler_id)
        return found

    async def forget_sampler(self, sampler_id: str) -> None:
        """Forget a sampler, and its adapter on the device when no other sampler has it."""
        sampler = self.samplers.pop(sampler_id, None)
        if sampler is None or sampler.key is None or self._adapters is None:
            return
        if not any(s.key == sampler.key for s in self.samplers.values()):
            await self._adapters.forget(sampler.key)

    async def end_session(self, session: Session) -> None:
        """Take a finished session's runs off the device and forget its samplers."""
        for sampler_id in list(session.samplers.values()):
            await self.forget_sampler(sampler_id)
        for run_id in session.runs:
            self.ephemeral.pop(run_id, None)
            await self.drop_run(run_id, f"its session {session.id} finished")

    async def drop_run(self, run_id: str, reason: str) -> None:
        run = self.runs.pop(run_id, None)
        if run is None:
            return
        for request_id in run.sequence.close(reason):
            self.futures.fail(request_id, f"training run {run_id!r} was closed: {reason}")
        if self._device is not None:
            try:
                await self._device.port.drop_tenant(run.device_name)
            except Exception as e:  # the device is closing or failed: nothing to free
                log.warning("could not drop %s from the device: %s", run.device_name, e)
        await asyncio.to_thread(self.store.close_run, run_id)
        log.info("tinker: training run %s closed (%s)", run_id, reason)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reap_every_s)
            for session in self.sessions.expire():
                try:
                    await self.end_session(session)
                except Exception:  # one session's cleanup never stops the reaper
                    log.exception("tinker: could not end session %s", session.id)
            self.sessions.forget_finished()
