"""The actors of the Ray backend. Each is a plain class here; `cluster.py` wraps it with
`ray.remote` and the resources of its role.

- `EngineReplica` (async actor): loads the base once from a path, holds its own
  `AdapterBank` and `RolloutEngine`, and serves `generate(request)` with continuous
  batching over every concurrent request it holds. Adapters arrive as tensors only
  (`publish`, `sync`), numbered exactly like the in-process bank.
- `TrainerWorker` (threaded with one thread: strictly one call at a time): a
  `MultiLaneTrainer` on its own copy of the base, with its primitives (add, restore,
  forward_backward, forward, optim_step, snapshot). `optim_step` returns the results
  and, as separate return objects, each tenant's new adapter, so the caller can hand
  those objects to the replicas without fetching them.
- `EnvWorker` (async actor, CPU) lives in `env_worker.py`, which imports no torch.

Every actor has an `incarnation` id, drawn when it is constructed: a restarted actor
(Ray `max_restarts`) is a new incarnation with empty state, which its client detects
(`ReplicaStale`, `EpisodeLost`) and repairs.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from marlaas.config.specs import LoRASpec, ModelDType
from marlaas.distributed.records import (
    ActorInfo,
    Rejected,
    ReplicaStale,
    ReplicaStats,
    TenantAdapters,
    actor_info,
)
from marlaas.model.bank import AdapterBank
from marlaas.model.base import load_base
from marlaas.model.lora import AdapterTensors, LoRAModel
from marlaas.rollout.engine import RolloutEngine
from marlaas.train.batch import TrainBatchError
from marlaas.train.optim import AdamParams, TenantSnapshot
from marlaas.train.records import OptimResult, TrainInput, TrainOutput
from marlaas.train.trainer import MultiLaneTrainer
from marlaas.types import Completion, RolloutRequest


def _device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _threads(n: int | None) -> None:
    if n is not None:
        torch.set_num_threads(n)


class EngineReplica:
    """One rollout engine on its own copy of the base (see the module docstring)."""

    def __init__(
        self,
        base_path: str,
        *,
        max_rank: int,
        adapter_slots: int,
        versions_kept: int,
        max_batch_size: int,
        max_prefill_tokens: int,
        seed: int,
        device: str = "auto",
        dtype: ModelDType = "auto",
        torch_threads: int | None = None,
    ) -> None:
        _threads(torch_threads)
        base, tokenizer = load_base(Path(base_path), dtype=dtype, device=_device(device))
        self.model = LoRAModel(base, max_rank=max_rank)
        self.bank = AdapterBank(self.model, num_slots=adapter_slots, versions_kept=versions_kept)
        self.engine = RolloutEngine(
            self.model,
            self.bank,
            tokenizer,
            max_batch_size=max_batch_size,
            max_prefill_tokens=max_prefill_tokens,
            background=False,
            seed=seed,
        )
        self.incarnation = uuid.uuid4().hex
        self._wake: asyncio.Event | None = None
        self._driver: asyncio.Task[None] | None = None
        self._busy_s = 0.0
        self._decode_steps = 0
        self._tokens = 0

    async def info(self) -> ActorInfo:
        return actor_info(self.incarnation)

    async def generate(self, request: RolloutRequest) -> Completion:
        """Serve one request; cancelling the call aborts it in the engine."""
        # Missing what was published means this replica restarted or missed a publish;
        # a version older than the kept window is the request's own error (as in-process).
        if request.tenant not in self.bank:
            raise ReplicaStale(f"replica has no adapter of tenant {request.tenant!r}")
        if request.version is not None and request.version > self.bank.latest_version(
            request.tenant
        ):
            raise ReplicaStale(
                f"replica has no version {request.version} of tenant {request.tenant!r} yet"
            )
        future = self.engine.submit(request)
        self._kick()
        return await future

    async def publish(self, tenant: str, version: int, tensors: AdapterTensors) -> None:
        """Add `version` of `tenant` (idempotent for versions already held). No await
        inside: calls from one client run in order and each runs whole."""
        if tenant not in self.bank:
            raise ReplicaStale(f"replica has no tenant {tenant!r} to publish version {version}")
        latest = self.bank.latest_version(tenant)
        if version <= latest:
            return
        if version != latest + 1:
            raise ReplicaStale(f"tenant {tenant!r}: replica is at {latest}, got {version}")
        self.engine.publish(tenant, version, tensors)

    async def sync(self, tenants: Sequence[TenantAdapters], *, prune: bool = False) -> ActorInfo:
        """Bring the bank up to the client's view: register missing tenants at their
        oldest kept version and publish the newer ones. `prune`: `tenants` is the
        client's whole view, so tenants not in it (removed while this replica was out)
        are removed here too."""
        refs = [ref for t in tenants for _, ref in t.versions]
        values = await asyncio.gather(*refs) if refs else []
        tensors_of = dict(zip([id(r) for r in refs], values, strict=True))
        if prune:
            wanted = {t.tenant for t in tenants}
            for name in self.bank.tenants():
                if name not in wanted:
                    self.bank.remove(name)
        for t in tenants:
            if not t.versions:
                continue
            kept = [(v, tensors_of[id(ref)]) for v, ref in t.versions]
            oldest_version, oldest = kept[0]
            if t.tenant in self.bank and self.bank.latest_version(t.tenant) < oldest_version - 1:
                self.bank.remove(t.tenant)  # too far behind to catch up version by version
            if t.tenant not in self.bank:
                self.bank.register(t.tenant, t.lora, tensors=oldest, version=oldest_version)
            for v, tensors in kept:
                if v > self.bank.latest_version(t.tenant):
                    self.engine.publish(t.tenant, v, tensors)
        return actor_info(self.incarnation)

    async def remove(self, tenant: str) -> None:
        """Forget `tenant` (idempotent); requests in flight keep the version they pinned."""
        if tenant in self.bank:
            self.bank.remove(tenant)

    async def held(self, tenant: str) -> list[int]:
        """The versions of `tenant` this replica can serve (empty: none)."""
        return self.bank.kept_versions(tenant) if tenant in self.bank else []

    async def stats(self) -> ReplicaStats:
        engine = self.engine.stats
        return ReplicaStats(
            self._busy_s,
            self._decode_steps,
            self._tokens,
            engine.prefill_tokens,
            engine.shared_prefill_tokens,
        )

    # -- the decode loop -------------------------------------------------------------

    def _kick(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive())
        self._wake.set()

    async def _drive(self) -> None:
        assert self._wake is not None
        while True:
            self._wake.clear()
            if self.engine.has_work():
                await asyncio.to_thread(self._run_until_idle)
            else:
                await self._wake.wait()

    def _run_until_idle(self) -> None:
        while self.engine.has_work():
            t0 = time.perf_counter()
            n = self.engine.step()
            if n > 0:
                self._busy_s += time.perf_counter() - t0
                self._decode_steps += 1
                self._tokens += n


class TrainerWorker:
    """A `MultiLaneTrainer` on its own copy of the base (see the module docstring)."""

    def __init__(
        self,
        base_path: str,
        *,
        max_rank: int,
        max_tokens_per_microbatch: int,
        device: str = "auto",
        dtype: ModelDType = "auto",
        torch_threads: int | None = None,
    ) -> None:
        _threads(torch_threads)
        base, _ = load_base(Path(base_path), dtype=dtype, device=_device(device))
        self.trainer = MultiLaneTrainer(
            LoRAModel(base, max_rank=max_rank), max_tokens_per_microbatch
        )
        self.incarnation = uuid.uuid4().hex
        self.busy_s = 0.0

    def info(self) -> ActorInfo:
        return actor_info(self.incarnation)

    def add(self, tenant: str, lora: LoRASpec, seed: int, snapshot: TenantSnapshot | None) -> int:
        return self.trainer.add(tenant, lora, seed=seed, snapshot=snapshot)

    def restore(self, snapshot: TenantSnapshot) -> int:
        return self.trainer.restore(snapshot)

    def remove(self, tenant: str) -> None:
        self.trainer.remove(tenant)

    def version(self, tenant: str) -> int:
        return self.trainer.version(tenant)

    def adapter(self, tenant: str) -> AdapterTensors:
        return self.trainer.adapter(tenant)

    def snapshot(self, tenant: str) -> TenantSnapshot:
        return self.trainer.snapshot(tenant)

    def tenants(self) -> list[str]:
        return self.trainer.tenants()

    def forward_backward(self, inputs: Sequence[TrainInput]) -> dict[str, TrainOutput] | Rejected:
        """The pass's outputs, or `Rejected` for a refused input (nothing changed)."""
        return self._timed(self.trainer.forward_backward, inputs)

    def forward(self, inputs: Sequence[TrainInput]) -> dict[str, TrainOutput] | Rejected:
        return self._timed(self.trainer.forward, inputs)

    def optim_step(self, steps: Sequence[tuple[str, AdamParams]]) -> tuple[Any, ...]:
        """`(results, adapter of step 0's tenant, adapter of step 1's, ...)`; call it
        with `num_returns=1 + len(steps)`."""
        t0 = time.perf_counter()
        try:
            results: dict[str, OptimResult] = self.trainer.optim_step(steps)
            return (results, *[self.trainer.adapter(tenant) for tenant, _ in steps])
        finally:
            self.busy_s += time.perf_counter() - t0

    def busy(self) -> float:
        return self.busy_s

    def _timed(self, run: Any, inputs: Sequence[TrainInput]) -> dict[str, TrainOutput] | Rejected:
        t0 = time.perf_counter()
        try:
            out: dict[str, TrainOutput] = run(inputs)
            return out
        except TrainBatchError as exc:
            return Rejected(exc.tenant, str(exc))
        finally:
            self.busy_s += time.perf_counter() - t0
