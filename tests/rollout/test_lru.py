"""The engine caches' LRU: bounded by entries and tokens, least recently used first out."""

from __future__ import annotations

from marlaas.rollout.lru import TokenLRU


def test_bounds_recency_and_oversized_entries() -> None:
    lru: TokenLRU[str, int] = TokenLRU(max_entries=3, max_tokens=10)
    for key, tokens in [("a", 3), ("b", 3), ("c", 3)]:
        lru.put(key, tokens, tokens)
    assert (len(lru), lru.cached_tokens) == (3, 9)
    assert lru.get("a") == 3  # now the most recent: "b" is the oldest
    lru.put("d", 1, 1)  # four entries: "b" goes
    assert lru.get("b") is None and len(lru) == 3
    lru.put("e", 5, 5)  # 4 entries, 12 tokens: the oldest, "c", goes
    assert [k for k in "acde" if lru.get(k) is not None] == ["a", "d", "e"]
    assert lru.cached_tokens == 9
    lru.put("big", 11, 11)  # larger than the whole budget: not kept, nothing dropped
    assert lru.get("big") is None and len(lru) == 3
    lru.put("d", 4, 4)  # replaced: 3 + 5 + 4 = 12 tokens, so the oldest, "a", goes
    assert lru.get("a") is None and lru.cached_tokens == 9
    assert lru.pop("d") == 4 and lru.pop("d") is None and lru.cached_tokens == 5
    lru.clear()
    assert (len(lru), lru.cached_tokens) == (0, 0)


def test_no_entries_keeps_nothing() -> None:
    lru: TokenLRU[str, int] = TokenLRU(max_entries=0, max_tokens=100)
    lru.put("a", 1, 1)
    assert len(lru) == 0 and lru.get("a") is None
