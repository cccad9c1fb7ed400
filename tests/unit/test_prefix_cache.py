"""The engine's prompt-prefix key/value cache: block boundaries, never the whole prompt, LRU budget."""

from __future__ import annotations

import torch

from deployments.engines.transformers.prefix_cache import PrefixCache


def _kv(prompt, layers=2):
    """Fake per-layer kv whose values encode the token id at each position (to check slicing)."""
    t = torch.tensor(prompt, dtype=torch.float32).view(1, 1, -1, 1)
    return [(t.clone(), -t.clone()) for _ in range(layers)]


def test_lookup_returns_longest_block_prefix_never_the_whole_prompt():
    cache = PrefixCache(block=4, max_tokens=100)
    a = list(range(10))  # usable: 8 tokens (block multiple, shorter than the prompt)
    cache.store(a, _kv(a))
    length, kv = cache.lookup(a)
    assert length == 8
    assert kv[0][0].flatten().tolist() == a[:8] and kv[1][1].flatten().tolist() == [-x for x in a[:8]]
    # a prompt sharing 6 tokens meets the cache at the 4-token boundary
    b = a[:6] + [99, 98, 97]
    assert cache.lookup(b)[0] == 4
    # exactly the stored prefix as a whole prompt: its last token must be computed, so 4 not 8
    assert cache.lookup(a[:8])[0] == 4
    assert cache.lookup([5, 6, 7, 8, 9])[0] == 0


def test_budget_evicts_least_recently_used():
    cache = PrefixCache(block=4, max_tokens=16)
    p1, p2, p3 = [1] * 9, [2] * 9, [3] * 9
    for p in (p1, p2):
        cache.store(p, _kv(p))
    assert cache.tokens == 16
    cache.lookup(p1)  # p1 is now the most recently used
    cache.store(p3, _kv(p3))
    assert cache.tokens == 16
    assert cache.lookup(p2)[0] == 0, "p2 was least recently used and must be gone"
    assert cache.lookup(p1)[0] == 8 and cache.lookup(p3)[0] == 8


def test_shared_prefix_survives_eviction_of_one_holder():
    cache = PrefixCache(block=4, max_tokens=16)
    a = [7, 7, 7, 7, 1, 1, 1, 1, 0]
    b = [7, 7, 7, 7, 2, 2, 2, 2, 0]
    cache.store(a, _kv(a))
    cache.store(b, _kv(b))
    cache.store([9] * 9, _kv([9] * 9))  # evicts a
    length, kv = cache.lookup([7, 7, 7, 7, 5, 5])
    assert length == 4 and kv[0][0].flatten().tolist() == [7, 7, 7, 7]


def test_disabled_cache_stores_nothing():
    cache = PrefixCache(block=4, max_tokens=0)
    p = list(range(20))
    cache.store(p, _kv(p))
    assert len(cache) == 0 and cache.lookup(p) == (0, None)
