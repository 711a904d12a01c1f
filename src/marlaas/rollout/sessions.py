"""Kept KV caches of finished turns, so a multi-turn episode prefills only its new tokens.

An entry holds the cache of `tokens` (the previous turn's prompt and completion minus
its last token, which was sampled but never fed to the model), the tenant and the
adapter version that computed it.

Invariants:
- An entry is reused only by a request of the same session, the same tenant and the
  same adapter version, and only for the prefix its prompt shares with `tokens`; a
  different version (or no shared prefix) recomputes everything.
- Entries are keyed by (tenant, session): one tenant's session names never reach or
  evict another tenant's caches.
- Taking an entry removes it (a session's cache is continued by one request at a time).
- Bounded: at most `max_sessions` entries and `max_tokens` cached tokens in all; the
  least recently stored entries are dropped first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from marlaas.rollout.kv import RowKV
from marlaas.rollout.lru import TokenLRU


@dataclass(frozen=True)
class SessionEntry:
    tenant: str
    version: int
    tokens: tuple[int, ...]
    kv: RowKV


class SessionCache:
    """An LRU of per-session KV caches, bounded by entry count and total tokens."""

    def __init__(self, max_sessions: int, max_tokens: int) -> None:
        self._lru: TokenLRU[tuple[str, str], SessionEntry] = TokenLRU(max_sessions, max_tokens)

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def cached_tokens(self) -> int:
        return self._lru.cached_tokens

    def put(self, session: str, entry: SessionEntry) -> None:
        self._lru.put((entry.tenant, session), entry, len(entry.tokens))

    def take(
        self, session: str, tenant: str, version: int, prompt: Sequence[int]
    ) -> tuple[int, RowKV | None]:
        """Remove the session's entry; return `(reusable prefix length, its cache)`.

        The reusable prefix is the longest common prefix of `prompt` and the cached
        tokens (causal attention: a prefix's KV does not depend on what follows), cut to
        leave at least one prompt token to prefill (the model needs a fresh position to
        predict from). `(0, None)` when nothing can be reused.
        """
        entry = self._lru.pop((tenant, session))
        if entry is None or entry.version != version:
            return 0, None
        n = len(entry.tokens)
        limit = min(n, len(prompt) - 1)
        keep = 0
        while keep < limit and prompt[keep] == entry.tokens[keep]:
            keep += 1
        if keep == 0:
            return 0, None
        kv = entry.kv if keep == n else entry.kv[:, :, :, :keep]
        return keep, kv

    def clear(self) -> None:
        self._lru.clear()
