"""The batched key/value cache of the decode batch, with a different length on every row.

Layout: per layer, keys and values are `[B, H, S, D]` (batch, kv heads, columns, head
dim). Row `b` holds `lengths_B[b]` valid tokens, right-aligned: its valid columns are
`[S - lengths_B[b], S)`, the columns before are padding (masked out, never read).

Invariants (hold between operations; `KVBatch` methods restore them):
- right-aligned: every row's valid entries are a suffix of the columns, in token order,
  so the padding mask is a function of `lengths_B` alone;
- trimmed: `S == max(lengths_B)` (no all-padding column), `S == 0` for an empty batch;
- the token in valid column `j` of row `b` has position `j - (S - lengths_B[b])`: rotary
  embeddings are applied before caching, so moving an entry to another column (merging,
  compacting) never changes what attention computes.

A forward wraps the tensors in a transformers `DynamicCache` (no copy), lets the model
append its new columns, and takes the grown tensors back (`forward_cache` /
`grown`). Only plain full-attention layers are supported (no sliding window).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache

from marlaas.errors import ModelError
from marlaas.model.cache import cache_tensors, wrap_cache

#: One sequence's cache: per layer `(keys [H, L, D], values [H, L, D])`.
RowKV = list[tuple[Tensor, Tensor]]


def _suffix_mask(lengths_B: Tensor, S: int, extra: int = 0) -> Tensor:
    """`[B, S + extra]` bool: the last `lengths_B[b]` of S columns, plus `extra` columns."""
    col_S = torch.arange(S + extra, device=lengths_B.device)
    return col_S.unsqueeze(0) >= (S - lengths_B).unsqueeze(-1)


@dataclass
class KVBatch:
    """Per-layer `[B, H, S, D]` keys/values, right-aligned and trimmed (see module doc)."""

    keys: list[Tensor]
    values: list[Tensor]
    lengths_B: Tensor

    @staticmethod
    def empty(
        num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> KVBatch:
        z = torch.zeros(0, kv_heads, 0, head_dim, dtype=dtype, device=device)
        return KVBatch(
            [z] * num_layers,
            [z] * num_layers,
            torch.zeros(0, dtype=torch.long, device=device),
        )

    @property
    def size(self) -> int:
        return int(self.lengths_B.shape[0])

    @property
    def width(self) -> int:
        return int(self.keys[0].shape[2])

    def mask_BS(self, extra: int = 0) -> Tensor:
        """The padding mask `[B, S + extra]` (1 = valid), `extra` valid columns appended."""
        return _suffix_mask(self.lengths_B, self.width, extra).long()

    def forward_cache(self) -> DynamicCache:
        """A `DynamicCache` over these tensors for one model forward (no copy)."""
        return wrap_cache(self.keys, self.values)

    @staticmethod
    def grown(cache: DynamicCache) -> tuple[list[Tensor], list[Tensor]]:
        """The per-layer keys and values a forward left in a `forward_cache()` cache."""
        return cache_tensors(cache)

    def select(self, rows_R: Tensor) -> KVBatch:
        """The rows `rows_R` (int64 indices), trimmed."""
        lengths_R = self.lengths_B[rows_R]
        S = self.width
        keep = int(lengths_R.max()) if lengths_R.numel() else 0
        keys = [k[rows_R, :, S - keep :] for k in self.keys]
        values = [v[rows_R, :, S - keep :] for v in self.values]
        return KVBatch(keys, values, lengths_R)

    @staticmethod
    def concat(a: KVBatch, b: KVBatch) -> KVBatch:
        """Rows of `a` then rows of `b`; the narrower one is left-padded with zeros."""
        if a.size == 0:
            return b
        if b.size == 0:
            return a
        S = max(a.width, b.width)

        def pad(t: Tensor) -> Tensor:
            missing = S - t.shape[2]
            return t if missing == 0 else torch.nn.functional.pad(t, (0, 0, missing, 0))

        keys = [torch.cat([pad(x), pad(y)]) for x, y in zip(a.keys, b.keys, strict=True)]
        values = [torch.cat([pad(x), pad(y)]) for x, y in zip(a.values, b.values, strict=True)]
        return KVBatch(keys, values, torch.cat([a.lengths_B, b.lengths_B]))

    @staticmethod
    def compact(keys: list[Tensor], values: list[Tensor], mask_BS: Tensor) -> KVBatch:
        """Right-align rows whose valid columns (`mask_BS` = 1) have holes, then trim.

        A stable sort of the mask moves every row's padding to the front while keeping
        its valid entries in token order: one gather per layer, no loop over rows.
        """
        mask_BS = mask_BS.bool()
        lengths_B = mask_BS.sum(-1)
        S = mask_BS.shape[1]
        keep = int(lengths_B.max()) if lengths_B.numel() else 0
        aligned = bool(torch.equal(mask_BS, KVBatch([keys[0]], [values[0]], lengths_B).mask_BS()))
        if not aligned:
            order_BS = torch.sort(mask_BS.to(torch.uint8), dim=-1, stable=True).indices
            order_BS = order_BS[:, S - keep :]
            H, D = keys[0].shape[1], keys[0].shape[3]
            index = order_BS[:, None, :, None].expand(-1, H, -1, D)
            keys = [k.gather(2, index) for k in keys]
            values = [v.gather(2, index) for v in values]
        else:
            keys = [k[:, :, S - keep :] for k in keys]
            values = [v[:, :, S - keep :] for v in values]
        return KVBatch(keys, values, lengths_B)

    def row(self, b: int) -> RowKV:
        """A contiguous copy of row `b`'s valid entries (to keep after the row leaves)."""
        n, S = int(self.lengths_B[b]), self.width
        return [
            (k[b, :, S - n :].clone(), v[b, :, S - n :].clone())
            for k, v in zip(self.keys, self.values, strict=True)
        ]

    @staticmethod
    def from_rows(rows: Sequence[RowKV | None], like: KVBatch) -> KVBatch:
        """Left-pad per-sequence caches into a batch (None = an empty row)."""
        lengths = [0 if r is None else int(r[0][0].shape[1]) for r in rows]
        S = max(lengths, default=0)
        ref = like.keys[0]
        H, D = ref.shape[1], ref.shape[3]
        keys: list[Tensor] = []
        values: list[Tensor] = []
        for layer in range(len(like.keys)):
            k = ref.new_zeros(len(rows), H, S, D)
            v = ref.new_zeros(len(rows), H, S, D)
            for i, r in enumerate(rows):
                if r is not None and lengths[i]:
                    k[i, :, S - lengths[i] :] = r[layer][0]
                    v[i, :, S - lengths[i] :] = r[layer][1]
            keys.append(k)
            values.append(v)
        return KVBatch(keys, values, torch.tensor(lengths, dtype=torch.long, device=ref.device))


def kv_geometry(config: object) -> tuple[int, int, int]:
    """`(num_layers, kv_heads, head_dim)` of a decoder config; `ModelError` if unsupported."""
    text: Any = (
        config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    )
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        if any(t != "full_attention" for t in layer_types):
            raise ModelError(
                "the rollout engine supports full-attention decoders only; this model has "
                f"layer types {sorted(set(layer_types))}"
            )
    elif getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        raise ModelError("the rollout engine does not support sliding-window attention")
    num_layers = int(text.num_hidden_layers)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return num_layers, kv_heads, head_dim
