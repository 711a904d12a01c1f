"""A least-recently-used map bounded by its entry count and by the tokens it holds.

The engine keeps two such caches of KV tensors (`sessions`: finished turns, `prompts`:
prompt prefills); an entry's size is its token count, which is what its tensors scale
with. Storing an entry drops the least recently used ones until both bounds hold; an
entry larger than `max_tokens` (or any entry when `max_entries < 1`) is not kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class TokenLRU(Generic[K, V]):
    """An LRU of `(value, tokens)` entries, bounded by count and total tokens."""

    def __init__(self, max_entries: int, max_tokens: int) -> None:
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def cached_tokens(self) -> int:
        return self._tokens

    def get(self, key: K) -> V | None:
        """The entry, now the most recently used one."""
        item = self._entries.get(key)
        if item is None:
            return None
        self._entries.move_to_end(key)
        return item[0]

    def pop(self, key: K) -> V | None:
        """Remove the entry and return it."""
        item = self._entries.pop(key, None)
        if item is None:
            return None
        self._tokens -= item[1]
        return item[0]

    def put(self, key: K, value: V, tokens: int) -> None:
        """Store (or replace) an entry of `tokens` tokens, dropping the oldest to fit."""
        self.pop(key)
        if self.max_entries < 1 or tokens > self.max_tokens:
            return
        self._entries[key] = (value, tokens)
        self._tokens += tokens
        while len(self._entries) > self.max_entries or self._tokens > self.max_tokens:
            self.pop(next(iter(self._entries)))

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0
