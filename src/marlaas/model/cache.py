"""Key/value caches handed to a Hugging Face forward as `past_key_values`.

- `wrap_cache` / `cache_tensors`: per-layer `[B, H, S, D]` tensors as a transformers
  `DynamicCache` of full-length layers, and back (the trainer shares one prompt's cache
  between the rows that start with it). Nothing is copied; the forward appends to the
  given tensors (autograd included). Every layer keeps every token, sliding-window layers
  too: the window is applied by the attention mask, never by dropping entries.
- `SlotCache`: the rollout engine's cache for one forward. The model writes its new
  keys and values in place into preallocated per-layer buffers
  `[rows, kv_heads, columns, head_dim]` (one `index_copy_` per layer, at flat indices
  computed once per forward) and attends to a view of the rows it runs on; nothing is
  concatenated or copied per token. It is meant for `marlaas.model.attention`'s
  `slot_attention` (the forward passes an `AttentionPlan`), which knows each row's length.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer


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


def empty_cache() -> DynamicCache:
    """An empty cache whose layers keep every token (a `DynamicCache` built from a config
    would give sliding-window layers that drop the oldest ones)."""
    return DynamicCache()


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


class SlotLayer(CacheLayerMixin):
    """One layer's buffers, written in place at `index` and read as rows
    `[row0, row0 + rows)`, columns `[0, columns)`."""

    is_sliding = False  # windows are masks here: every token stays in the buffer
    is_compileable = False

    def __init__(
        self, keys: Tensor, values: Tensor, index: Tensor, row0: int, rows: int, columns: int
    ) -> None:
        super().__init__()
        self.keys, self.values = keys, values
        self.is_initialized = True
        self._index = index
        self._rows = slice(row0, row0 + rows)
        self._columns = columns

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        return None  # the buffers exist before the forward

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: object, **kwargs: object
    ) -> tuple[Tensor, Tensor]:
        """Write `[R, Hkv, N, D]` new states in place (in the buffers' dtype); the rows'
        keys and values."""
        assert self.keys is not None and self.values is not None
        D, dtype = self.keys.shape[-1], self.keys.dtype
        # Flat order (row, token, head): a view of how the projections laid them out.
        k_TD = key_states.transpose(1, 2).reshape(-1, D).to(dtype)
        v_TD = value_states.transpose(1, 2).reshape(-1, D).to(dtype)
        self.keys.view(-1, D).index_copy_(0, self._index, k_TD)
        self.values.view(-1, D).index_copy_(0, self._index, v_TD)
        return (
            self.keys[self._rows, :, : self._columns],
            self.values[self._rows, :, : self._columns],
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._columns, 0

    def get_seq_length(self) -> int:
        return self._columns

    def get_max_length(self) -> int:
        return int(self.keys.shape[2]) if self.keys is not None else -1


class SlotCache(Cache):
    """The `Cache` of one engine forward: one `SlotLayer` per decoder layer."""

    def __init__(self, layers: list[SlotLayer]) -> None:
        super().__init__(layers=list(layers))
