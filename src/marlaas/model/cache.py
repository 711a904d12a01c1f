"""Per-layer key/value tensors as a transformers `DynamicCache`, and back.

The rollout engine keeps its batch's cache as plain tensors, and the trainer shares one
prompt's cache between the rows that start with it; both hand such tensors to a Hugging
Face forward as `past_key_values` and take the grown tensors back. Nothing is copied:
the cache holds the given tensors, and the forward appends to them (autograd included).
Only plain full-attention layers are supported (no sliding window).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor
from transformers.cache_utils import DynamicCache, DynamicLayer


def wrap_cache(keys: Sequence[Tensor], values: Sequence[Tensor]) -> DynamicCache:
    """A `DynamicCache` over per-layer `[B, H, S, D]` keys and values (no copy)."""
    cache = DynamicCache()
    layers: list[DynamicLayer] = []
    for k, v in zip(keys, values, strict=True):
        layer = DynamicLayer()
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
        layers.append(layer)
    cache.layers = layers  # type: ignore[assignment]
    return cache


def cache_tensors(cache: DynamicCache) -> tuple[list[Tensor], list[Tensor]]:
    """The per-layer keys and values a forward left in `cache`."""
    keys: list[Tensor] = []
    values: list[Tensor] = []
    for layer in cache.layers:
        assert isinstance(layer, DynamicLayer) and layer.keys is not None
        assert layer.values is not None
        keys.append(layer.keys)
        values.append(layer.values)
    return keys, values
