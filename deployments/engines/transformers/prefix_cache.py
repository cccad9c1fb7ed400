"""Prompt-prefix key/value cache for the decode engine.

Chat prompts of one service share long prefixes: the chat template, the default or scenario system
prompt. On a CPU replica reading those prompt tokens costs more than generating a short
constrained answer, and batching helps little there. The engine therefore keeps the key/value
tensors of prompt prefixes it has already computed and starts a new prompt's prefill after the
longest cached prefix.

Prefixes are cut at multiples of ``block`` tokens (so prompts that differ only after the shared part
still meet on a block boundary) and never cover a whole prompt (the last prompt token is always
computed, it yields the first logits). Memory is bounded by ``max_tokens`` cached tokens in total,
least recently used first out.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

__all__ = ["PrefixCache"]


class PrefixCache:
    """LRU of ``prefix tokens -> per-layer (keys, values)`` tensors of shape ``(1, heads, L, dim)``.

    Args:
        block: prefix lengths are multiples of this many tokens.
        max_tokens: most cached tokens in total (0 disables the cache).
        max_prefix: longest prefix stored.
    """

    def __init__(self, *, block: int = 16, max_tokens: int = 8192, max_prefix: int = 1024):
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.block = block
        self.max_tokens = max_tokens
        self.max_prefix = max_prefix
        # base entries: one per stored prompt prefix, keyed by its tokens
        self._bases: OrderedDict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
        # every block boundary of every base -> the base that holds it
        self._index: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.tokens = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._bases)

    def _limit(self, prompt_len: int) -> int:
        """Longest prefix length usable for a prompt of ``prompt_len`` tokens (block multiple, < prompt)."""
        return min((prompt_len - 1) // self.block * self.block, self.max_prefix // self.block * self.block)

    def lookup(self, prompt: list[int]) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """``(length, per-layer kv)`` of the longest cached prefix of ``prompt``, or ``(0, None)``."""
        if self.max_tokens <= 0:
            return 0, None
        for length in range(self._limit(len(prompt)), 0, -self.block):
            base = self._index.get(tuple(prompt[:length]))
            if base is not None:
                self._bases.move_to_end(base)
                self.hits += 1
                return length, [(k[:, :, :length], v[:, :, :length]) for k, v in self._bases[base]]
        self.misses += 1
        return 0, None

    def store(self, prompt: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Remember the block prefixes of ``prompt``; ``kv`` holds at least its first ``_limit`` tokens
        as ``(1, heads, >=L, dim)`` tensors in prompt order."""
        length = self._limit(len(prompt))
        if self.max_tokens <= 0 or length <= 0 or length > self.max_tokens:
            return
        key = tuple(prompt[:length])
        if key in self._bases:
            self._bases.move_to_end(key)
            return
        self._bases[key] = [(k[:, :, :length].clone(), v[:, :, :length].clone()) for k, v in kv]
        self.tokens += length
        for cut in range(self.block, length + 1, self.block):
            self._index[key[:cut]] = key
        while self.tokens > self.max_tokens:
            self._evict()

    def _evict(self) -> None:
        key, _ = self._bases.popitem(last=False)
        self.tokens -= len(key)
        for cut in range(self.block, len(key) + 1, self.block):
            prefix = key[:cut]
            if self._index.get(prefix) == key:
                # another base may hold the same prefix: point there, or forget it
                other = next((b for b in self._bases if b[:cut] == prefix), None)
                if other is None:
                    del self._index[prefix]
                else:
                    self._index[prefix] = other
