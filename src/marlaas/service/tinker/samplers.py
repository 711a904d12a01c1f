"""Samplers: what a Tinker sampling client samples from, and the frozen adapters on the
device that serve them.

A sampler samples the plain base, or a fixed adapter: sampler weights or a saved
state on disk (`tinker://...` paths), or the weights a training client exported for
`save_weights_and_get_sampling_client` (kept in memory, never on disk: the SDK calls
them ephemeral). Every one samples exactly the weights it was created with, whatever
its training run does next ("snapshot" semantics).

`SamplerAdapters` keeps those adapters registered on the device as frozen adapters
(`DevicePort.add_adapter`), loaded on first use and bounded by `capacity`: the least
recently used one without a request in flight is dropped first, so a request's
adapter is never dropped under it; it is loaded again when asked for again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from marlaas.config.specs import LoRASpec
from marlaas.device.port import BASE, DevicePort
from marlaas.model.lora import AdapterTensors

log = logging.getLogger(__name__)

Loader = Callable[[], Awaitable[tuple[LoRASpec, AdapterTensors]]]


@dataclass(frozen=True)
class Sampler:
    """A sampling client's target. `key` names its weights (the same weights, the same
    key: two samplers of one path share one adapter); None samples the base."""

    id: str
    owner: str
    session_id: str
    base_model: str
    model_path: str | None
    key: str | None
    load: Loader | None


class SamplerAdapters:
    """Frozen adapters of samplers on the device (see the module docstring). Event-loop
    only."""

    def __init__(self, device: DevicePort, capacity: int = 32) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.device = device
        self.capacity = capacity
        self._names: OrderedDict[str, str] = OrderedDict()  # key -> device name, LRU first
        self._pins: dict[str, int] = {}
        self._loading: dict[str, asyncio.Future[str]] = {}
        self._counter = itertools.count()

    @property
    def registered(self) -> int:
        return len(self._names)

    @asynccontextmanager
    async def use(self, sampler: Sampler) -> AsyncIterator[str]:
        """The device name to sample `sampler` with, held while the block runs."""
        if sampler.key is None or sampler.load is None:
            yield BASE
            return
        key = sampler.key
        self._pins[key] = self._pins.get(key, 0) + 1
        try:
            name = self._names.get(key)
            if name is None:
                loading = self._loading.get(key)
                if loading is None:
                    loading = self._loading[key] = asyncio.ensure_future(
                        self._register(key, sampler.load)
                    )
                name = await asyncio.shield(loading)
            self._names.move_to_end(key)
            yield name
        finally:
            self._pins[key] -= 1
            if self._pins[key] == 0:
                del self._pins[key]
            await self._evict()

    async def forget(self, key: str) -> None:
        """Drop `key`'s adapter now unless a request uses it (then at its end, by LRU)."""
        if key in self._pins:
            return
        name = self._names.pop(key, None)
        if name is not None:
            await self._drop(name)

    async def _register(self, key: str, load: Loader) -> str:
        try:
            spec, tensors = await load()
            name = f"tinker-sampler:{next(self._counter)}"
            await self.device.add_adapter(name, spec, tensors)
            self._names[key] = name
            log.info("tinker sampler %s loaded as %s", key, name)
            return name
        finally:
            del self._loading[key]

    async def _evict(self) -> None:
        while len(self._names) > self.capacity:
            idle = next((k for k in self._names if k not in self._pins), None)
            if idle is None:  # all in use: trimmed when one is released
                return
            await self._drop(self._names.pop(idle))

    async def _drop(self, name: str) -> None:
        try:
            await self.device.drop_adapter(name)
        except Exception as e:  # e.g. a device that is closing: nothing is left to free
            log.warning("could not drop tinker sampler adapter %s: %s", name, e)
