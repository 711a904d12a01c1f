"""`RayTrainerClient`: the `MultiLaneTrainer` surface, served by a trainer actor, and
the trainer's recovery from checkpoints.

The pipeline calls the trainer only from the executor's thread (`executor.call`,
`executor.train`), so every method here blocks on its actor call; it is not meant for
the event loop.

Recovery: when the actor dies (`RayActorError` on any call), the client starts a new
one and rebuilds each registered tenant from the newest checkpoint of that tenant that
was written in this run (a version it handed out as a `snapshot`, found complete on
disk), else from how the tenant was registered or restored; it then replays the tenant's
train batches since that point, one step each, in order. A step is a deterministic
function of the adapter, optimizer state and batch, so the tenant ends at exactly the
version it had (the same adapter up to floating-point noise), the interrupted call is
retried once on the new actor, and the run continues as if nothing happened. The
batches are kept only back to the newest checkpoint on disk, so the replay log is
bounded by `checkpoint_every`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import ray
from ray.exceptions import RayActorError, RayTaskError

from marlaas.config.specs import GRPOSpec, LoRASpec
from marlaas.distributed.records import ActorInfo, Rejected, unwrap
from marlaas.errors import ModelError
from marlaas.model.lora import AdapterTensors, LoRAModel
from marlaas.obs.recorder import NullRecorder, Recorder
from marlaas.train.batch import TenantStepResult, TrainBatch, TrainBatchError
from marlaas.train.checkpoint import latest_checkpoint, load_checkpoint
from marlaas.train.grpo import GRPOSnapshot as TenantSnapshot

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class _Registration:
    """The arguments of `register`, to register the tenant again on a new actor."""

    lora: LoRASpec
    algo: GRPOSpec
    tensors: AdapterTensors | None
    seed: int
    temperature: float
    warmup_steps: int
    constant_norm_tokens: float | None


@dataclass(eq=False)
class _Tenant:
    origin: _Registration | TenantSnapshot
    origin_version: int
    #: Versions handed out by `snapshot` (candidates for checkpoints on disk).
    snapshots: set[int] = field(default_factory=set)
    #: Batches trained since the newest checkpoint on disk, in step order.
    log: list[TrainBatch] = field(default_factory=list)


class RayTrainerClient:
    """The trainer of a Ray context (see the module docstring).

    `make_actor()` starts a trainer actor; `model` is the driver's weightless copy of the
    base (shapes only, for reading checkpoints); `checkpoint_dir(tenant)` is where the
    pipeline writes the tenant's checkpoints.
    """

    def __init__(
        self,
        make_actor: Callable[[], Any],
        model: LoRAModel,
        checkpoint_dir: Callable[[str], Path],
        recorder: Recorder | None = None,
    ) -> None:
        self._make_actor = make_actor
        self.model = model
        self._checkpoint_dir = checkpoint_dir
        self.recorder: Recorder = recorder or NullRecorder()
        self._lock = threading.RLock()
        self._tenants: dict[str, _Tenant] = {}
        self.actor = make_actor()
        try:
            self.info: ActorInfo = ray.get(self.actor.info.remote())
        except RayActorError as e:
            raise ModelError(f"the trainer actor failed to start: {e}") from e
        self.restores = 0

    # -- the MultiLaneTrainer surface ----------------------------------------------------

    def register(
        self,
        tenant: str,
        lora: LoRASpec,
        algo: GRPOSpec,
        tensors: AdapterTensors | None = None,
        seed: int = 0,
        temperature: float = 1.0,
        *,
        warmup_steps: int = 0,
        constant_norm_tokens: float | None = None,
    ) -> None:
        reg = _Registration(
            lora, algo, tensors, seed, temperature, warmup_steps, constant_norm_tokens
        )
        with self._lock:
            self._call(lambda a: a.register.remote(tenant, *_register_args(reg)))
            self._tenants[tenant] = _Tenant(reg, 0)

    def restore(self, snapshot: TenantSnapshot) -> None:
        with self._lock:
            self._call(lambda a: a.restore.remote(snapshot))
            self._tenants[snapshot.tenant] = _Tenant(snapshot, snapshot.version)

    def remove(self, tenant: str) -> None:
        with self._lock:
            self._call(lambda a: a.remove.remote(tenant))
            self._tenants.pop(tenant, None)

    def tenants(self) -> list[str]:
        with self._lock:
            return list(self._call(lambda a: a.tenants.remote()))

    def __contains__(self, tenant: object) -> bool:
        with self._lock:
            return tenant in self._tenants

    def version(self, tenant: str) -> int:
        with self._lock:
            return int(self._call(lambda a: a.version.remote(tenant)))

    def adapter(self, tenant: str) -> AdapterTensors:
        with self._lock:
            tensors: AdapterTensors = self._call(lambda a: a.adapter.remote(tenant))
            return tensors

    def snapshot(self, tenant: str) -> TenantSnapshot:
        with self._lock:
            snap: TenantSnapshot = self._call(lambda a: a.snapshot.remote(tenant))
            record = self._tenants.get(tenant)
            if record is not None:
                record.snapshots.add(snap.version)
            return snap

    def step(self, batches: Sequence[TrainBatch]) -> dict[str, TenantStepResult]:
        results, _ = self.step_refs(batches)
        return results

    def step_refs(
        self, batches: Sequence[TrainBatch]
    ) -> tuple[dict[str, TenantStepResult], dict[str, Any]]:
        """One multi-lane step; returns the results and, per tenant, the object ref of its
        new adapter (owned by this process: it outlives the actor). Raises
        `TrainBatchError` for a rejected batch, having changed nothing."""
        if not batches:
            return {}, {}
        with self._lock:
            refs: list[Any] = []

            def send(actor: Any) -> Any:
                refs[:] = actor.step.options(num_returns=1 + len(batches)).remote(list(batches))
                return refs[0]

            head = self._call(send)
            if isinstance(head, Rejected):
                raise TrainBatchError(
                    head.tenant, head.message.removeprefix(f"tenant {head.tenant!r}: ")
                )
            for batch in batches:
                self._logged(batch)
            return head, {b.tenant: refs[1 + i] for i, b in enumerate(batches)}

    def close(self) -> None:
        """Kill the trainer actor (the tenants' state is in their checkpoints)."""
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)

    # -- recovery --------------------------------------------------------------------

    def _call(self, send: Callable[[Any], Any]) -> Any:
        """`ray.get(send(actor))`; after the actor's death, recover and retry once."""
        try:
            return _get(send(self.actor))
        except RayActorError as exc:
            log.warning("the trainer actor died (%s); restoring it from checkpoints", exc)
            self._recover()
            return _get(send(self.actor))

    def _logged(self, batch: TrainBatch) -> None:
        record = self._tenants.get(batch.tenant)
        if record is None:
            return
        record.log.append(batch)
        path = latest_checkpoint(self._checkpoint_dir(batch.tenant))
        done = _version_of(path) if path is not None else None
        if done is not None and done in record.snapshots:
            record.log = [b for b in record.log if b.step >= done]

    def _recover(self) -> None:
        """A new actor with every tenant where it was (see the module docstring)."""
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)
        self.actor = self._make_actor()
        self.info = ray.get(self.actor.info.remote())
        for name, record in self._tenants.items():
            start = self._start_point(name, record)
            if isinstance(start, TenantSnapshot):
                _get(self.actor.restore.remote(start))
                version = start.version
            else:
                _get(self.actor.register.remote(name, *_register_args(start)))
                version = 0
            replayed = 0
            for batch in record.log:
                if batch.step < version:
                    continue
                head = _get(self.actor.step.options(num_returns=2).remote([batch])[0])
                if isinstance(head, Rejected):
                    raise ModelError(f"replaying tenant {name!r} failed: {head.message}")
                version, replayed = version + 1, replayed + 1
            self.recorder.event(
                "trainer_restored",
                tenant=name,
                version=version,
                from_version=version - replayed,
                replayed=replayed,
            )
        self.restores += 1

    def _start_point(self, name: str, record: _Tenant) -> _Registration | TenantSnapshot:
        """The newest checkpoint of this run on disk, else the tenant's origin."""
        path = latest_checkpoint(self._checkpoint_dir(name))
        version = _version_of(path) if path is not None else None
        if version is None or version not in record.snapshots or version < record.origin_version:
            return record.origin
        assert path is not None
        snapshot = load_checkpoint(path, self.model).snapshot
        # The schedule in force is the one the tenant was registered or restored with.
        origin = record.origin
        if isinstance(origin, TenantSnapshot):
            training = origin.training
        else:
            training = replace(snapshot.training, algo=origin.algo, temperature=origin.temperature)
        return replace(snapshot, training=training)


def _register_args(reg: _Registration) -> tuple[Any, ...]:
    return (
        reg.lora,
        reg.algo,
        reg.tensors,
        reg.seed,
        reg.temperature,
        reg.warmup_steps,
        reg.constant_norm_tokens,
    )


def _version_of(path: Path) -> int:
    return int(path.name.removeprefix("ckpt-"))


def _get(ref: Any) -> Any:
    """`ray.get`, raising what the actor raised (not Ray's wrapper); actor deaths pass."""
    try:
        return ray.get(ref)
    except RayTaskError as exc:
        raise unwrap(exc) from None
