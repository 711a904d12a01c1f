"""`RayEngineClient`: the sampler of the Ray device, served by engine replicas.

The device's `RequestGate` keeps deciding the fair order of requests (this client is
its `EngineFront`); it moves them into this client (`enqueue`) while
`running + queued < capacity` (replicas x rows per replica). The client sends each request to one healthy replica (the same one as the
previous turn of its session when possible, for the session's KV cache; else the least
loaded) and calls `deliver` exactly once with the `Completion` or the error.

Versions: `register` adds a tenant at one version (a fresh one at 0, a restored one at
its snapshot's), `publish` records each next version's tensors as an object ref and
hands the same ref to every healthy replica, and returns only when every one holds it,
so, exactly as in-process, a request admitted after `publish` returns samples the new
version. Every
healthy replica holds every tenant's current version, so any replica may serve any
request. The client keeps the refs of each tenant's newest `versions_kept` versions, to
bring a restarted replica up to date. `remove` forgets a tenant on every replica (the
service's serving adapters come and go this way); a replica that was out meanwhile
drops it when it is synced back. A request for a tenant the client does not hold fails
with `TenantNotFound`, as in-process.

Routing (which replica serves a request) and the per-replica and per-request records
live in `routing`.

The client does not stream tokens (`streams_tokens` is False): a caller that asked for
them gets them all with the completion.

Faults: a replica that dies (`RayActorError`) or answers `ReplicaStale` (it restarted
and lost its adapters) leaves the healthy set; its requests go to another replica
(each at most `request_retries` times). A recovery thread waits for Ray to restart it,
replays the kept versions into it (`EngineReplica.sync`, under the publish lock so no
version is missed), and puts it back. A request is identified by its `request_id`: a
second answer for it (never expected, but cheap to guard) is dropped, so no completion
is delivered, hence no trajectory counted, twice.

Shutdown order (`shutdown`): stop accepting -> fail queued and in-flight requests with
`EngineClosed` -> stop recovery threads -> kill the replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future as ThreadFuture
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError, TaskCancelledError

from marlaas.config.specs import LoRASpec
from marlaas.distributed.records import (
    DEAD_AFTER_FAILURES,
    ActorInfo,
    ClientStats,
    ReplicaStale,
    ReplicaStats,
    TenantAdapters,
    unwrap,
)
from marlaas.distributed.routing import PendingRequest, ReplicaSlot, choose_replica, healthy
from marlaas.errors import EngineClosed, ModelError, TenantNotFound
from marlaas.model.lora import AdapterTensors, LoRAModel
from marlaas.rollout.batch import Deliver, TokenListener
from marlaas.types import Completion, RolloutRequest

log = logging.getLogger(__name__)

#: Seconds a publish waits for one replica before taking it out to be recovered.
PUBLISH_TIMEOUT_S = 30.0


@dataclass(eq=False)
class _Tenant:
    lora: LoRASpec
    versions: deque[tuple[int, Any]] = field(default_factory=deque)


class RayEngineClient:
    """The sampler of the Ray device (see the module docstring)."""

    #: Replicas answer whole completions: no token listener is ever called.
    streams_tokens = False

    def __init__(
        self,
        replicas: Sequence[Any],
        model: LoRAModel,
        *,
        rows_per_replica: int,
        versions_kept: int,
        request_retries: int = 3,
    ) -> None:
        if not replicas:
            raise ValueError("a Ray engine needs at least one replica")
        self.model = model  # the driver's weightless copy: validates specs and shapes
        self.rows_per_replica = rows_per_replica
        self.versions_kept = versions_kept
        self.request_retries = request_retries
        self.stats = ClientStats()
        #: Called (from any thread, never under the client's locks) when rows free up.
        self.on_room: Callable[[], None] | None = None
        self._replicas = [ReplicaSlot(i, h) for i, h in enumerate(replicas)]
        self._lock = threading.Lock()  # requests, replicas' health, sessions
        self._publish_lock = threading.Lock()  # versions and replica syncs, in order
        self._requests: dict[str, PendingRequest] = {}
        self._parked: deque[PendingRequest] = deque()
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._tenants: dict[str, _Tenant] = {}
        self._closing = False
        self._closed = threading.Event()
        try:
            infos: list[ActorInfo] = ray.get([r.handle.info.remote() for r in self._replicas])
        except RayActorError as e:
            raise ModelError(f"a rollout replica failed to start: {e}") from e
        for r, info in zip(self._replicas, infos, strict=True):
            r.incarnation, r.node_id = info.incarnation, info.node_id
        # Answers are handled on this thread, never on Ray's callback thread.
        self._inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._dispatcher = threading.Thread(
            target=self._serve_inbox, name="marlaas-ray-dispatch", daemon=True
        )
        self._dispatcher.start()

    # -- the engine surface the gate and the pipeline use -----------------------------

    @property
    def capacity(self) -> int:
        return self.rows_per_replica * len(self._replicas)

    @property
    def running(self) -> int:
        with self._lock:
            return sum(1 for r in self._requests.values() if r.replica is not None)

    @property
    def queued(self) -> int:
        with self._lock:
            return len(self._parked)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._requests)

    def enqueue(
        self, request: RolloutRequest, deliver: Deliver, listener: TokenListener | None = None
    ) -> None:
        """Send `request` to a replica; `deliver` gets its answer once (any thread)."""
        if listener is not None:
            raise ValueError("the Ray engine does not stream tokens (streams_tokens is False)")
        item = PendingRequest(request, deliver)
        with self._lock:
            if self._closing:
                raise EngineClosed("the Ray rollout engine is closed; build a new context")
            if request.request_id in self._requests:
                raise ValueError(f"request id {request.request_id!r} is already in flight")
            self._requests[request.request_id] = item
        self._dispatch(item)

    def abort(self, request_id: str) -> None:
        """Stop a request: a parked one is answered with `CancelledError` at once, a
        running one when its replica has aborted it."""
        with self._lock:
            item = self._requests.get(request_id)
            if item is None:
                return
            item.aborted = True
            ref = item.ref
            parked = item in self._parked
            if parked:
                self._parked.remove(item)
        if parked:
            self._finish(item, asyncio.CancelledError(f"request {request_id}"))
        elif ref is not None:
            with contextlib.suppress(Exception):
                ray.cancel(ref)

    # -- adapters ----------------------------------------------------------------------

    def register(
        self, tenant: str, lora: LoRASpec, tensors: AdapterTensors, version: int = 0
    ) -> None:
        """Register `tenant` at `version` with `tensors` on every replica. Raises
        `ModelError`, as `AdapterBank.register` does, for a tenant already registered or
        tensors that do not fit `lora` and the base."""
        self.model.validate_spec(lora)
        self.model.check_tensors(lora, tensors)
        ref = ray.put(tensors)
        with self._publish_lock:
            if tenant in self._tenants:
                raise ModelError(f"tenant {tenant!r} is already registered; remove it first")
            versions = deque([(version, ref)], maxlen=self.versions_kept)
            self._tenants[tenant] = _Tenant(lora, versions)
            self._sync_all([tenant])

    def publish_ref(self, tenant: str, version: int, ref: Any) -> None:
        """Publish a version already in the object store; returns when every healthy
        replica holds it (a replica that fails here is recovered, then holds it too)."""
        with self._publish_lock:
            record = self._tenants.get(tenant)
            if record is None:
                raise TenantNotFound(f"tenant {tenant!r} is not registered in the Ray engine")
            latest = record.versions[-1][0]
            if version != latest + 1:
                raise ModelError(
                    f"tenant {tenant!r}: published version {version}, but the latest is "
                    f"{latest}; versions go up by exactly one"
                )
            record.versions.append((version, ref))
            targets = self._healthy()
            calls = [(r, r.handle.publish.remote(tenant, version, ref)) for r in targets]
            self.stats.publishes += 1
            for r, call in calls:
                self._settle_control(r, call)

    def remove(self, tenant: str) -> None:
        """Forget `tenant` on every replica, as `AdapterBank.remove` does (requests in
        flight keep the version they pinned; later ones fail with `TenantNotFound`).
        A replica that is out meanwhile drops it when it is synced back."""
        with self._publish_lock:
            if self._tenants.pop(tenant, None) is None:
                raise TenantNotFound(f"tenant {tenant!r} is not registered in the Ray engine")
            calls = [(r, r.handle.remove.remote(tenant)) for r in self._healthy()]
            for r, call in calls:
                self._settle_control(r, call)

    def __contains__(self, tenant: object) -> bool:
        return tenant in self._tenants  # one dict lookup: atomic, no lock needed

    def tenants(self) -> list[str]:
        with self._publish_lock:
            return list(self._tenants)

    def latest_version(self, tenant: str) -> int:
        with self._publish_lock:
            record = self._tenants.get(tenant)
            if record is None:
                raise TenantNotFound(f"tenant {tenant!r} is not registered in the Ray engine")
            return record.versions[-1][0]

    def held_versions(self) -> dict[int, dict[str, list[int]]]:
        """Per healthy replica index, the versions it holds of every tenant."""
        with self._publish_lock:
            tenants = list(self._tenants)
            replicas = self._healthy()
        out: dict[int, dict[str, list[int]]] = {}
        for r in replicas:
            calls = [r.handle.held.remote(t) for t in tenants]
            out[r.index] = dict(zip(tenants, ray.get(calls), strict=True))
        return out

    # -- figures and lifecycle ---------------------------------------------------------

    @property
    def handles(self) -> list[Any]:
        return [r.handle for r in self._replicas]

    @property
    def restarts(self) -> int:
        return sum(r.restarts for r in self._replicas)

    def replica_stats(self, timeout_s: float = 10.0) -> list[ReplicaStats]:
        """Each live replica's decode figures (dead ones are left out)."""
        out: list[ReplicaStats] = []
        for r in self._replicas:
            with contextlib.suppress(Exception):
                out.append(ray.get(r.handle.stats.remote(), timeout=timeout_s))
        return out

    def shutdown(self) -> None:
        """Stop (see the shutdown order in the module docstring)."""
        with self._lock:
            self._closing = True
            items = list(self._requests.values())
        for item in items:
            self._finish(item, EngineClosed("the Ray rollout engine was closed before this"))
        self._closed.set()
        self._inbox.put(None)
        for r in self._replicas:
            with contextlib.suppress(Exception):
                ray.kill(r.handle, no_restart=True)

    # -- dispatch ----------------------------------------------------------------------

    def _healthy(self) -> list[ReplicaSlot]:
        return healthy(self._replicas)

    def _dispatch(self, item: PendingRequest) -> None:
        """Send `item` to a replica, park it until one is back, or answer it."""
        rid = item.request.request_id
        error: BaseException | None = None
        with self._lock:
            if self._requests.get(rid) is not item:
                return  # answered meanwhile
            replica = (
                None
                if item.aborted
                else choose_replica(self._replicas, self._sessions, item.request)
            )
            if item.aborted:
                error = asyncio.CancelledError(f"request {rid}")
            elif item.request.tenant not in self._tenants:  # as the in-process bank says
                error = TenantNotFound(
                    f"request {rid}: tenant {item.request.tenant!r} is not registered"
                )
            elif replica is None and all(r.dead for r in self._replicas):
                error = EngineClosed("every rollout replica died for good")
            elif replica is None:
                self._parked.append(item)  # sent when a replica is back
                return
            else:
                item.replica = replica.index
                replica.inflight += 1
                item.ref = replica.handle.generate.remote(item.request)
        if error is not None or replica is None:
            self._finish(item, error or EngineClosed("no rollout replica"))
            return
        item.ref.future().add_done_callback(
            lambda f, it=item, rep=replica: self._inbox.put(lambda: self._answered(it, rep, f))
        )

    def _serve_inbox(self) -> None:
        while True:
            job = self._inbox.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # a bug here must not stop every other answer
                log.exception("handling a replica's answer failed")

    def _answered(
        self, item: PendingRequest, replica: ReplicaSlot, done: ThreadFuture[Any]
    ) -> None:
        with self._lock:
            replica.inflight -= 1
            item.replica = None
        if done.cancelled():
            self._finish(item, asyncio.CancelledError(f"request {item.request.request_id}"))
            return
        exc = done.exception()
        if exc is None:
            self._finish(item, done.result())
            return
        cause = unwrap(exc)
        if item.aborted or isinstance(exc, TaskCancelledError | asyncio.CancelledError):
            self._finish(item, asyncio.CancelledError(f"request {item.request.request_id}"))
            return
        if isinstance(exc, RayActorError) or isinstance(cause, ReplicaStale):
            self._lost(replica, cause)
            item.attempts += 1
            if item.attempts > self.request_retries:
                self._finish(
                    item,
                    EngineClosed(
                        f"request {item.request.request_id} lost its replica "
                        f"{item.attempts} times; last error: {cause}"
                    ),
                )
                return
            self.stats.retries += 1
            self._dispatch(item)
            return
        self._finish(item, cause)

    def _finish(self, item: PendingRequest, result: Completion | BaseException) -> None:
        """Deliver once per request id; later answers for the same id are dropped."""
        with self._lock:
            if self._requests.get(item.request.request_id) is not item:
                self.stats.duplicates_dropped += 1
                return
            del self._requests[item.request.request_id]
            with contextlib.suppress(ValueError):
                self._parked.remove(item)
            if isinstance(result, Completion):
                self.stats.delivered += 1
        try:
            item.deliver(result)
        finally:
            if self.on_room is not None:
                self.on_room()

    # -- faults ------------------------------------------------------------------------

    def _settle_control(self, replica: ReplicaSlot, call: Any) -> None:
        """Wait for a publish; a replica that failed it is taken out and recovered."""
        try:
            ray.get(call, timeout=PUBLISH_TIMEOUT_S)
        except GetTimeoutError as exc:  # e.g. being restarted: its recovery syncs it
            self._lost(replica, exc)
        except (RayActorError, RayTaskError) as exc:
            cause = unwrap(exc)
            if not isinstance(exc, RayActorError) and not isinstance(cause, ReplicaStale):
                raise cause from None
            self._lost(replica, cause)

    def _lost(self, replica: ReplicaSlot, cause: BaseException) -> None:
        """Take `replica` out of the healthy set and start its recovery (once)."""
        with self._lock:
            if not replica.healthy or self._closing:
                return
            replica.healthy = False
            self.stats.replica_failures += 1
        log.warning("rollout replica %d lost (%s); recovering it", replica.index, cause)
        threading.Thread(
            target=self._recover,
            args=(replica,),
            name=f"marlaas-replica-{replica.index}",
            daemon=True,
        ).start()

    def _recover(self, replica: ReplicaSlot) -> None:
        """Wait for Ray to restart the replica, replay the kept versions, put it back.

        Calls to an actor that Ray is restarting wait for it, so `info` returns once it
        is back; an actor out of restarts fails every call at once, so a run of failures
        means it is gone for good."""
        failures = 0
        while not self._closed.is_set():
            try:
                ray.get(replica.handle.info.remote())  # outside the lock: may take a while
                with self._publish_lock:  # no version can be published meanwhile
                    info: ActorInfo = ray.get(
                        replica.handle.sync.remote(self._adapters(), prune=True)
                    )
                    with self._lock:
                        if info.incarnation != replica.incarnation:
                            replica.restarts += 1
                        replica.incarnation, replica.node_id = info.incarnation, info.node_id
                        replica.healthy = True
                        self.stats.recoveries += 1
            except (RayActorError, RayTaskError) as exc:
                failures += 1
                if failures >= DEAD_AFTER_FAILURES:
                    log.error("rollout replica %d is gone for good: %s", replica.index, exc)
                    with self._lock:
                        replica.dead = True
                    self._flush_parked()
                    return
                self._closed.wait(0.2)  # the death may not have reached Ray's GCS yet
                continue
            self._flush_parked()
            return

    def _flush_parked(self) -> None:
        with self._lock:
            parked, self._parked = list(self._parked), deque()
        for item in parked:
            self._dispatch(item)
        if self.on_room is not None:
            self.on_room()

    def _adapters(self) -> list[TenantAdapters]:
        return [
            TenantAdapters(name, t.lora, tuple(t.versions)) for name, t in self._tenants.items()
        ]

    def _sync_all(self, tenants: list[str]) -> None:
        """Under the publish lock: send these tenants' kept versions to healthy replicas."""
        wanted = [a for a in self._adapters() if a.tenant in tenants]
        for r in self._healthy():
            try:
                ray.get(r.handle.sync.remote(wanted))
            except RayActorError as exc:
                self._lost(r, exc)
