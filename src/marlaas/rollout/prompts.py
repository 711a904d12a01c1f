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

from dataclasses import dataclass

from torch import Tensor

from marlaas.rollout.kv import RowKV
from marlaas.rollout.lru import TokenLRU

PromptKey = tuple[int, tuple[int, ...]]


@dataclass(frozen=True)
class PromptEntry:
    """A prompt's prefill: per-layer KV of all its tokens and its last logits `[V]`."""

    kv: RowKV
    logits_V: Tensor


class PromptCache:
    """An LRU of prompt prefills, bounded by entry count and total tokens."""

    def __init__(self, max_entries: int, max_tokens: int) -> None:
        self._lru: TokenLRU[PromptKey, PromptEntry] = TokenLRU(max_entries, max_tokens)

    def get(self, adapter_id: int, prompt: tuple[int, ...]) -> PromptEntry | None:
        return self._lru.get((adapter_id, prompt))

    def put(self, adapter_id: int, prompt: tuple[int, ...], entry: PromptEntry) -> None:
        self._lru.put((adapter_id, prompt), entry, len(prompt))

    def clear(self) -> None:
        self._lru.clear()
