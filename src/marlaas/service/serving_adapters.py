"""Serving adapters: checkpoint adapters added to the provider (the device, or the
service's own engine) for inference.

Invariants:
- Serving adapters are named `serve:<job id>:<step>`, names no training tenant uses;
  the base is the provider's `base_adapter`. At most `capacity` of them stay added; the
  least recently used one without requests in flight is removed first (and the
  request that made room returns only once it is gone), so a request's adapter is
  never removed under it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from marlaas.service.inference_limits import BadInferenceRequest
from marlaas.service.models_catalog import ServedModel

if TYPE_CHECKING:
    from marlaas.service.inference import InferenceProvider

log = logging.getLogger(__name__)


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
            yield self.provider.base_adapter
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
            await self._evict()

    async def _load(self, key: str, directory: Path) -> None:
        from marlaas.errors import ModelError
        from marlaas.model.peft_io import load_peft

        provider = self.provider
        try:
            if not provider.has_adapter(key):  # else a previous cache left it: same files
                spec, tensors = await asyncio.to_thread(load_peft, directory, provider.model)
                if not provider.has_adapter(key):
                    await provider.add_adapter(key, spec, tensors)
            self._registered[key] = None
            log.info("serving adapter %s loaded from %s", key, directory)
        except ModelError as e:
            raise BadInferenceRequest(
                f"this checkpoint's adapter cannot be served by this engine: {e}", "model"
            ) from e
        finally:
            del self._loading[key]
        await self._evict()

    async def _evict(self) -> None:
        while len(self._registered) > self.capacity:
            idle = next((k for k in self._registered if k not in self._pins), None)
            if idle is None:  # every one is in use: trimmed when one is released
                return
            del self._registered[idle]
            await self.provider.drop_adapter(idle)
            log.info("serving adapter %s unloaded (least recently used)", idle)
