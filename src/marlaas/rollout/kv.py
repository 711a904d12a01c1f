"""The decode batch's key/value cache: buffers allocated once, written in place.

Layout: per layer, keys and values are `[rows, H, columns, D]` buffers (kv heads, head
dim; in the model's `kv_dtype`: bfloat16 on a CPU running bfloat16 linears), all views
of one `[layers, 2, rows, H, columns, D]` buffer, so rows' whole caches are moved, kept
(`export_rows`) or restored (`import_rows`) in one op rather than two per layer and row
(in the pipeline every op of the device thread may wait on the event loop's hold of the
interpreter: ~13 us an op on this 2-core machine while the loop runs Python, against
~1-2 us alone). Batch row
`b` is buffer row `b`, and its token at position `j` sits in column `j`:
row `b` holds `lengths_B[b]` valid columns `[0, lengths_B[b])`. A forward writes its new
tokens' entries straight into their columns (`SlotCache`), so decoding never
concatenates or copies the cache; the last column is a scratch column where left padding
of a prefill writes what nobody reads.

The buffers grow geometrically (rows and columns doubled, up to `max_rows` and the
model's positions) when a batch needs more, which happens a logarithmic number of times,
and are released when the batch empties. Rows that leave are replaced by moving the last
rows into their place (`move_rows`), so the batch's rows stay `0 .. B-1` and a view of
them is all attention reads. Memory is rows x the longest row's columns (a paged layout
would bound it by the tokens held instead; at the engine's batch sizes and contexts the
rectangle is what attention reads anyway).

Invariants:
- Columns at or beyond a row's length hold finite values (zeros, or an earlier
  occupant's entries), never read as valid: attention masks them.
- A row's entries do not depend on the other rows: moving or sharing a row copies
  exactly its valid columns.
- Sliding windows never drop entries: every token of a row stays, the attention mask
  applies the window (so a session or prompt cache entry serves any window).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from marlaas.errors import ModelError
from marlaas.model.arch import check_attention
from marlaas.model.cache import SlotCache, SlotLayer
from marlaas.model.kernels import copy_rows

#: One sequence's cache: `[layers, 2 (keys, values), H, L, D]`.
RowKV = Tensor


@dataclass(frozen=True)
class KVGeometry:
    """What the cache must hold per token: layers, kv heads, head dim, each layer's window."""

    num_layers: int
    kv_heads: int
    head_dim: int
    #: Per layer: its sliding window (None = full attention).
    windows: tuple[int | None, ...]


@dataclass
class SlotWrites:
    """Where one forward's `T = R * N` new tokens go in the cache buffers: token `t`
    (row-major over the forward's rows and tokens) into buffer row `row_T[t]`, column
    `col_T[t]`."""

    row_T: Tensor
    col_T: Tensor
    kv_heads: int
    #: Columns of the buffers.
    capacity: int

    @functools.cached_property
    def flat(self) -> Tensor:
        """Each (token, kv head)'s index in a buffer seen as `[rows * H * columns, D]`,
        `[T * H]` in (token, head) order: the order the projections lay them out."""
        head_H = torch.arange(self.kv_heads, device=self.row_T.device)
        index_TH = (self.row_T[:, None] * self.kv_heads + head_H) * self.capacity
        return (index_TH + self.col_T[:, None]).reshape(-1)


def kv_geometry(config: object) -> KVGeometry:
    """The cache geometry of a decoder config; `ModelError` for layers it cannot hold."""
    text: Any = (
        config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    )
    check_attention(text)
    num_layers = int(text.num_hidden_layers)
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        windows = tuple(
            int(window) if t == "sliding_attention" and window else None for t in layer_types
        )
    elif window and getattr(text, "use_sliding_window", True):
        windows = (int(window),) * num_layers
    else:
        windows = (None,) * num_layers
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return KVGeometry(num_layers, kv_heads, head_dim, windows)


def _grown(needed: int, have: int, limit: int, floor: int) -> int:
    size = max(have, floor)
    while size < needed:
        size *= 2
    return max(min(size, limit), needed)


class SlotKV:
    """Per-layer `[rows, H, columns, D]` key and value buffers, views of one buffer (see
    the module doc)."""

    def __init__(
        self,
        geometry: KVGeometry,
        dtype: torch.dtype,
        device: torch.device,
        max_rows: int,
        max_positions: int | None,
    ) -> None:
        self.geometry = geometry
        self.dtype = dtype
        self.device = device
        self.max_rows = max_rows
        # A row needs at most max_positions columns; one more is the scratch column.
        self._col_limit = (max_positions + 1) if max_positions else 1 << 30
        #: Every layer's keys and values in one buffer `[layers, 2, rows, H, columns, D]`
        #: (a row's whole cache moves, leaves and returns in one op); `keys[l]` and
        #: `values[l]` are its `[rows, H, columns, D]` views.
        self.buffer = self._zeros(0, 0)
        self.keys, self.values = self._views_of(self.buffer)

    @property
    def rows(self) -> int:
        return int(self.keys[0].shape[0])

    @property
    def usable_columns(self) -> int:
        """Columns a row may fill (the last one is the scratch column)."""
        return max(int(self.keys[0].shape[2]) - 1, 0)

    def _zeros(self, rows: int, columns: int) -> Tensor:
        # Zeros, not empty: masked columns are multiplied by probability 0, and 0 * NaN
        # (uninitialised memory) would still be NaN.
        g = self.geometry
        return torch.zeros(
            (g.num_layers, 2, rows, g.kv_heads, columns, g.head_dim),
            dtype=self.dtype,
            device=self.device,
        )

    @staticmethod
    def _views_of(buffer: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        return list(buffer[:, 0].unbind(0)), list(buffer[:, 1].unbind(0))

    def _alloc(self, rows: int, columns: int) -> None:
        """New buffers of `rows` x `columns`, holding what the old ones held (all but the
        old scratch column, which becomes an ordinary one)."""
        old, self.buffer = self.buffer, self._zeros(rows, columns)
        r, c = min(rows, old.shape[2]), min(columns, old.shape[4]) - 1
        if r > 0 and c > 0:
            self.buffer[:, :, :r, :, :c].copy_(old[:, :, :r, :, :c])
        self.keys, self.values = self._views_of(self.buffer)

    def reserve(self, rows: int, columns: int) -> None:
        """Make room for `rows` rows of `columns` valid columns each (grows geometrically)."""
        if rows > self.max_rows:
            raise ModelError(f"the cache holds at most {self.max_rows} rows, asked for {rows}")
        if columns + 1 > self._col_limit:
            raise ModelError(
                f"a row of {columns} tokens exceeds the model's {self._col_limit - 1} positions"
            )
        have_rows, have_cols = self.rows, int(self.keys[0].shape[2])
        if rows <= have_rows and columns + 1 <= have_cols:
            return
        self._alloc(
            _grown(rows, have_rows, self.max_rows, 8),
            _grown(columns + 1, have_cols, self._col_limit, 64),
        )

    def release(self) -> None:
        """Free the buffers (the batch is empty); the next `reserve` allocates again."""
        if self.rows:
            self.buffer = self._zeros(0, 0)
            self.keys, self.values = self._views_of(self.buffer)

    def writes(self, row0: int, positions_RN: Tensor) -> SlotWrites:
        """Where the new tokens of a forward over rows `row0 ..` at `positions_RN` (-1:
        padding, written to the scratch column) go."""
        R, N = (int(n) for n in positions_RN.shape)
        cap = int(self.keys[0].shape[2])
        col_T = torch.where(positions_RN >= 0, positions_RN, cap - 1).reshape(-1)
        row_T = torch.arange(row0, row0 + R, device=positions_RN.device).repeat_interleave(N)
        return SlotWrites(row_T, col_T, self.geometry.kv_heads, cap)

    def cache(self, row0: int, positions_RN: Tensor, columns: int) -> SlotCache:
        """The `SlotCache` of a forward over rows `row0 ..` with new tokens at
        `positions_RN` (-1: padding, written to the scratch column), reading `columns`."""
        R = int(positions_RN.shape[0])
        flat = self.writes(row0, positions_RN).flat
        return SlotCache(
            [
                SlotLayer(k, v, flat, row0, R, columns)
                for k, v in zip(self.keys, self.values, strict=True)
            ]
        )

    def store(self, layer: int, writes: SlotWrites, k_THD: Tensor, v_THD: Tensor) -> None:
        """Write new keys and values `[T, Hkv, D]` (tokens in `writes` order) into
        `layer`'s buffers (rounded to the cache's dtype)."""
        D = self.geometry.head_dim
        k_TD, v_TD = k_THD.reshape(-1, D).to(self.dtype), v_THD.reshape(-1, D).to(self.dtype)
        self.keys[layer].view(-1, D).index_copy_(0, writes.flat, k_TD)
        self.values[layer].view(-1, D).index_copy_(0, writes.flat, v_TD)

    def views(self, layer: int, row0: int, rows: int, columns: int) -> tuple[Tensor, Tensor]:
        """`layer`'s keys and values of rows `row0 ..`, their first `columns` columns."""
        return (
            self.keys[layer][row0 : row0 + rows, :, :columns],
            self.values[layer][row0 : row0 + rows, :, :columns],
        )

    def move_rows(self, dst: Sequence[int], src: Sequence[int], columns: int) -> None:
        """Copy rows `src` into rows `dst` (their first `columns` columns), all at once:
        the sources are read before any destination is written."""
        if not dst or copy_rows(self.buffer, dst, src, columns):  # one pass where it can
            return
        d = torch.tensor(list(dst), dtype=torch.long, device=self.device)
        s = torch.tensor(list(src), dtype=torch.long, device=self.device)
        view = self.buffer[:, :, :, :, :columns]
        view.index_copy_(2, d, view.index_select(2, s))

    def export_rows(self, rows: Sequence[int], lengths: Sequence[int]) -> list[RowKV]:
        """Contiguous copies of rows `rows`' first `lengths` entries (to keep after they
        leave), made in one op: each op of the device thread may wait for the event
        loop's hold of the interpreter lock."""
        views = [self.buffer[:, :, b, :, :n] for b, n in zip(rows, lengths, strict=True)]
        return list(torch._foreach_clone(views)) if views else []

    def import_rows(self, rows: Sequence[int], kvs: Sequence[RowKV]) -> None:
        """Write kept caches into rows `rows`' first columns, in one op."""
        if rows:
            views = [
                self.buffer[:, :, b, :, : kv.shape[3]] for b, kv in zip(rows, kvs, strict=True)
            ]
            torch._foreach_copy_(views, list(kvs))
