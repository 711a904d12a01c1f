"""`RayTrainerClient`: the trainer's primitives (`MultiLaneTrainer`), served by a
trainer actor, and the trainer's recovery when that actor dies.

The device executor calls the trainer only from its own thread, so every method here
blocks on its actor call; it is not meant for the event loop.

Recovery points: the client keeps, per tenant, a point to rebuild it from -- how it was
added (a seed, or a snapshot, put in the object store) or the newest snapshot of it:
one handed out by `snapshot` (a checkpoint), or one the client takes itself, as an
object the driver never fetches, after every `snapshot_every` optimizer steps -- and a
log of the state-changing calls since that point (its `forward_backward` inputs and
`optim_step` parameters). A snapshot holds no accumulated gradient, so the
`forward_backward` inputs since the tenant's last optimizer step stay in the log.

Recovery: when the actor dies (`RayActorError` on any call), the client starts a new
one, rebuilds each tenant from its point and replays its log in order, each call alone
(a pass is a deterministic function of the adapter and the data, and tenants in one pass
never affect each other), so the tenant ends at exactly the version it had (the same
adapter up to floating-point noise); the interrupted call is retried once on the new
actor, and the device goes on as if nothing happened. The log is bounded by
`snapshot_every` optimizer steps. A snapshot lives in the object store of the node that
made it: losing that node loses the point, and recovery fails with `ModelError`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import ObjectLostError, RayActorError, RayTaskError

from marlaas.config.specs import LoRASpec
from marlaas.distributed.records import ActorInfo, Rejected, unwrap
from marlaas.errors import ModelError
from marlaas.model.lora import AdapterTensors
from marlaas.obs.recorder import NullRecorder, Recorder
from marlaas.train.batch import TrainBatchError
from marlaas.train.optim import AdamParams, TenantSnapshot
from marlaas.train.records import OptimResult, TrainInput, TrainOutput

log = logging.getLogger(__name__)

#: Optimizer steps of a tenant after which the client snapshots it for recovery.
SNAPSHOT_EVERY = 8


@dataclass(eq=False)
class _Tenant:
    lora: LoRASpec
    seed: int
    #: The recovery point: an object ref of a `TenantSnapshot`, or None (add from seed).
    point: Any
    point_version: int
    #: State-changing calls since the point, in order: `TrainInput` or `AdamParams`.
    log: list[TrainInput | AdamParams] = field(default_factory=list)

    def reset(self, point: Any, version: int) -> None:
        """A new recovery point: keep only the passes since the last optimizer step."""
        last = max((i for i, e in enumerate(self.log) if isinstance(e, AdamParams)), default=-1)
        self.point, self.point_version = point, version
        self.log = self.log[last + 1 :]

    @property
    def steps_logged(self) -> int:
        return sum(1 for e in self.log if isinstance(e, AdamParams))


class RayTrainerClient:
    """The trainer of the Ray device (see the module docstring).

    `make_actor()` starts a trainer actor.
    """

    def __init__(
        self,
        make_actor: Callable[[], Any],
        recorder: Recorder | None = None,
        snapshot_every: int = SNAPSHOT_EVERY,
    ) -> None:
        self._make_actor = make_actor
        self.recorder: Recorder = recorder or NullRecorder()
        self.snapshot_every = snapshot_every
        self._lock = threading.RLock()
        self._tenants: dict[str, _Tenant] = {}
        self.actor = make_actor()
        try:
            self.info: ActorInfo = ray.get(self.actor.info.remote())
        except RayActorError as e:
            raise ModelError(f"the trainer actor failed to start: {e}") from e
        self.restores = 0

    # -- tenants -----------------------------------------------------------------------

    def add(self, tenant: str, lora: LoRASpec, seed: int, snapshot: TenantSnapshot | None) -> int:
        with self._lock:
            version = int(self._call(lambda a: a.add.remote(tenant, lora, seed, snapshot)))
            point = None if snapshot is None else ray.put(snapshot)
            self._tenants[tenant] = _Tenant(lora, seed, point, version)
            return version

    def restore(self, snapshot: TenantSnapshot) -> int:
        with self._lock:
            version = int(self._call(lambda a: a.restore.remote(snapshot)))
            self._tenants[snapshot.tenant] = _Tenant(snapshot.lora, 0, ray.put(snapshot), version)
            return version

    def remove(self, tenant: str) -> None:
        with self._lock:
            self._call(lambda a: a.remove.remote(tenant))
            self._tenants.pop(tenant, None)

    def __contains__(self, tenant: object) -> bool:
        return tenant in self._tenants  # one dict lookup: atomic, no lock needed

    def version(self, tenant: str) -> int:
        with self._lock:
            return int(self._call(lambda a: a.version.remote(tenant)))

    def adapter(self, tenant: str) -> AdapterTensors:
        with self._lock:
            tensors: AdapterTensors = self._call(lambda a: a.adapter.remote(tenant))
            return tensors

    def snapshot(self, tenant: str) -> TenantSnapshot:
        """The tenant's state (a new recovery point for it)."""
        with self._lock:
            refs: list[Any] = []

            def send(actor: Any) -> Any:
                refs[:] = [actor.snapshot.remote(tenant)]
                return refs[0]

            snap: TenantSnapshot = self._call(send)
            record = self._tenants.get(tenant)
            if record is not None:
                record.reset(refs[0], snap.version)
            return snap

    # -- training --------------------------------------------------------------------

    def forward_backward(self, inputs: Sequence[TrainInput]) -> dict[str, TrainOutput]:
        """One pass; raises `TrainBatchError` for a refused input, having changed nothing."""
        with self._lock:
            out = self._pass(lambda a: a.forward_backward.remote(list(inputs)))
            for inp in inputs:
                record = self._tenants.get(inp.tenant)
                if record is not None:
                    record.log.append(inp)
            return out

    def forward(self, inputs: Sequence[TrainInput]) -> dict[str, TrainOutput]:
        with self._lock:
            return self._pass(lambda a: a.forward.remote(list(inputs)))

    def optim_step(
        self, steps: Sequence[tuple[str, AdamParams]]
    ) -> tuple[dict[str, OptimResult], dict[str, Any]]:
        """One batched optimizer step; returns the results and, per tenant, the object
        ref of its new adapter (owned by this process: it outlives the actor)."""
        if not steps:
            return {}, {}
        with self._lock:
            refs: list[Any] = []

            def send(actor: Any) -> Any:
                refs[:] = actor.optim_step.options(num_returns=1 + len(steps)).remote(list(steps))
                return refs[0]

            results: dict[str, OptimResult] = self._call(send)
            for tenant, params in steps:
                record = self._tenants.get(tenant)
                if record is None:
                    continue
                record.log.append(params)
                if record.steps_logged >= self.snapshot_every:
                    record.reset(self.actor.snapshot.remote(tenant), results[tenant].version)
            return results, {tenant: refs[1 + i] for i, (tenant, _) in enumerate(steps)}

    def close(self) -> None:
        """Kill the trainer actor."""
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)

    # -- recovery --------------------------------------------------------------------

    def _pass(self, send: Callable[[Any], Any]) -> dict[str, TrainOutput]:
        out = self._call(send)
        if isinstance(out, Rejected):
            raise TrainBatchError(out.tenant, out.message.removeprefix(f"tenant {out.tenant!r}: "))
        result: dict[str, TrainOutput] = out
        return result

    def _call(self, send: Callable[[Any], Any]) -> Any:
        """`ray.get(send(actor))`; after the actor's death, recover and retry once."""
        try:
            return _get(send(self.actor))
        except RayActorError as exc:
            log.warning("the trainer actor died (%s); restoring it from snapshots", exc)
            self._recover()
            return _get(send(self.actor))

    def _recover(self) -> None:
        """A new actor with every tenant where it was (see the module docstring)."""
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)
        self.actor = self._make_actor()
        self.info = ray.get(self.actor.info.remote())
        for name, record in self._tenants.items():
            if record.point is None:
                version = int(_get(self.actor.add.remote(name, record.lora, record.seed, None)))
            else:
                try:
                    snapshot: TenantSnapshot = ray.get(record.point)
                except ObjectLostError as e:
                    raise ModelError(
                        f"tenant {name!r}: its recovery snapshot was lost with its node ({e})"
                    ) from e
                version = int(_get(self.actor.add.remote(name, record.lora, 0, snapshot)))
            start, replayed = version, 0
            for entry in record.log:
                if isinstance(entry, AdamParams):
                    call = self.actor.optim_step.options(num_returns=2).remote([(name, entry)])
                    version, replayed = _get(call[0])[name].version, replayed + 1
                else:
                    out = _get(self.actor.forward_backward.remote([entry]))
                    if isinstance(out, Rejected):
                        raise ModelError(f"replaying tenant {name!r} failed: {out.message}")
            self.recorder.event(
                "trainer_restored",
                tenant=name,
                version=version,
                from_version=start,
                replayed=replayed,
            )
        self.restores += 1


def _get(ref: Any) -> Any:
    """`ray.get`, raising what the actor raised (not Ray's wrapper); actor deaths pass."""
    try:
        return ray.get(ref)
    except RayTaskError as exc:
        raise unwrap(exc) from None
