"""Kept prefills of recent prompts, so the samples of one prompt are prefilled once.

A GRPO step asks for several samples of each prompt, and they reach the engine over
several iterations as rows free up. The first one's prefill (its KV cache and the
logits of its last position) is kept here; a later request with the same prompt under
the same adapter takes a copy and goes straight to sampling its first token, with its
own seed.

Invariants:
- An entry is keyed by the adapter's `adapter_id` (one tenant's one version in one
  bank) and the whole prompt: it is reused only by a request whose prompt and adapter
  weights are exactly the ones that computed it, so what a request gets back does not
  depend on whether its prefill was shared.
- Entries are read, never changed: a hit's tensors are copied into the batch.
- Bounded: at most `max_entries` entries and `max_tokens` cached prompt tokens; the
  least recently used entries are dropped first. `max_entries = 0` keeps nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from torch import Tensor

from marlaas.rollout.kv import RowKV

PromptKey = tuple[int, tuple[int, ...]]


@dataclass(frozen=True)
class PromptEntry:
    """A prompt's prefill: per-layer KV of all its tokens and its last logits `[V]`."""

    kv: RowKV
    logits_V: Tensor


class PromptCache:
    """An LRU of prompt prefills, bounded by entry count and total tokens."""

    def __init__(self, max_entries: int, max_tokens: int) -> None:
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._entries: OrderedDict[PromptKey, PromptEntry] = OrderedDict()
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def cached_tokens(self) -> int:
        return self._tokens

    def get(self, adapter_id: int, prompt: tuple[int, ...]) -> PromptEntry | None:
        key = (adapter_id, prompt)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, adapter_id: int, prompt: tuple[int, ...], entry: PromptEntry) -> None:
        key = (adapter_id, prompt)
        self._drop(key)
        if self.max_entries < 1 or len(prompt) > self.max_tokens:
            return
        self._entries[key] = entry
        self._tokens += len(prompt)
        while len(self._entries) > self.max_entries or self._tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0

    def _drop(self, key: PromptKey) -> None:
        if self._entries.pop(key, None) is not None:
            self._tokens -= len(key[1])
