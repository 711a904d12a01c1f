"""The session KV cache: bounded LRU, prefix matching, version and tenant checks."""

from __future__ import annotations

import torch

from marlaas.rollout.sessions import SessionCache, SessionEntry


def _entry(tokens: tuple[int, ...], tenant: str = "a", version: int = 0) -> SessionEntry:
    n = len(tokens)
    keys = torch.arange(n, dtype=torch.float32)[None, :, None]
    kv = torch.stack((keys, torch.zeros(1, n, 1)))[None]  # [layers, 2, H, n, D]
    return SessionEntry(tenant, version, tokens, kv)


def test_take_reuses_the_common_prefix_and_removes_the_entry() -> None:
    cache = SessionCache(max_sessions=4, max_tokens=100)
    cache.put("s", _entry((1, 2, 3, 4)))
    keep, kv = cache.take("s", "a", 0, (1, 2, 9, 9, 9))
    assert keep == 2 and kv is not None and kv[0][0].shape[1] == 2
    assert len(cache) == 0 and cache.take("s", "a", 0, (1, 2, 3)) == (0, None)


def test_take_leaves_one_token_to_prefill() -> None:
    cache = SessionCache(max_sessions=4, max_tokens=100)
    cache.put("s", _entry((1, 2, 3)))
    keep, kv = cache.take("s", "a", 0, (1, 2, 3))
    assert keep == 2 and kv is not None and kv[0][0][0, :, 0].tolist() == [0.0, 1.0]


def test_version_and_tenant_must_match() -> None:
    cache = SessionCache(max_sessions=4, max_tokens=100)
    cache.put("s", _entry((1, 2, 3), version=1))
    assert cache.take("s", "b", 1, (1, 2, 3, 4)) == (0, None)
    assert len(cache) == 1  # another tenant's request does not evict it
    assert cache.take("s", "a", 2, (1, 2, 3, 4)) == (0, None)
    assert len(cache) == 0


def test_bounded_by_count_and_tokens_least_recent_first() -> None:
    cache = SessionCache(max_sessions=2, max_tokens=10)
    cache.put("s1", _entry((1,) * 4))
    cache.put("s2", _entry((2,) * 4))
    cache.put("s3", _entry((3,) * 4))
    assert len(cache) == 2 and cache.take("s1", "a", 0, (1,) * 5) == (0, None)
    cache.put("s4", _entry((4,) * 8))
    assert len(cache) == 1 and cache.cached_tokens == 8
    cache.put("big", _entry((5,) * 11))  # larger than the whole budget: not kept
    assert len(cache) == 1
