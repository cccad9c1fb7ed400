"""Packed tables of a fixed-depth catalog: every item is ``depth`` tokens then the end token (semantic ids).

The layout is the CSR of :class:`processors.tables.MaskTables` with everything a fixed depth makes implicit left
out. States and edges are numbered breadth-first: the root is state 0, then the states of depth 1, 2, ... in the
order of their paths. In a tree every state but the root has exactly one incoming edge, and breadth-first order
numbers edges and the states they reach alike, so **the edge ``e`` leads to the state ``e + 1``**, and an edge of the
last level (an item's last token) to ``LEAF`` (where only the end token is allowed), as in the tables compiled from a
catalog: no ``next_state`` array. No ``keys`` array either: a transition is a search inside its state's sorted
tokens. Per-state item metrics are implicit too: every item is equally far from a state of a given depth, and the
items under a state are one contiguous range of the last level's edges (breadth-first order keeps the order of
paths).

What is stored: ``offsets`` (one entry per state that has edges: ``uint32`` while the edges fit, else ``int64``) and
``codes`` (one entry per edge: the token minus its level's smallest token, ``uint16`` when each level's tokens span
at most 65,536 ids, else ``int32``). At 10^7 items of 4 tokens that is about 6-10 bytes per item (against ~77 for
``MaskTables`` with its keys, targets and metrics).

The answers are those of ``MaskTables`` compiled from the same items (``tests/unit/test_packed_tree.py`` walks both):
:meth:`allowed`, :meth:`step` (``LEAF`` for a token without an edge, ``DONE`` after the end token),
:meth:`children` (the beam step's gather for many rows at once), :meth:`advance` (many rows' transitions at once),
:meth:`item_count` and :meth:`min_remaining`.
"""

from __future__ import annotations

import numpy as np

__all__ = ["DONE", "LEAF", "PackedTree"]

LEAF = -1
DONE = -2


def _sorted_unique_rows(ids: np.ndarray) -> np.ndarray:
    """``ids`` (items x depth) sorted by path, duplicates dropped. When every column's span of ids fits together in
    63 bits (semantic ids: a few bits per level), the rows are packed into one integer each, column 0 highest, and
    sorted as integers (one ``np.sort``); otherwise the columns are lexsorted."""
    if ids.shape[0] <= 1:
        return ids
    low = ids.min(axis=0).astype(np.int64)
    bits = [max(int(span).bit_length(), 1) for span in (ids.max(axis=0).astype(np.int64) - low)]
    if sum(bits) <= 63:
        shifts = np.cumsum([0] + bits[::-1])[:-1][::-1]  # column c sits above the columns after it
        key = np.zeros(ids.shape[0], dtype=np.int64)
        for col, shift in enumerate(shifts):
            key |= (ids[:, col].astype(np.int64) - low[col]) << int(shift)
        key.sort()  # (np.unique would hash first: several times slower here)
        if key.size > 1:
            keep = np.empty(key.size, dtype=bool)
            keep[0] = True
            np.not_equal(key[1:], key[:-1], out=keep[1:])
            if not keep.all():
                key = key[keep]
        out = np.empty((key.size, ids.shape[1]), dtype=ids.dtype)
        for col, shift in enumerate(shifts):
            out[:, col] = ((key >> int(shift)) & ((1 << bits[col]) - 1)) + low[col]
        return out
    order = np.lexsort(ids.T[::-1])
    ids = ids[order]
    same = np.ones(ids.shape[0] - 1, dtype=bool)
    for col in range(ids.shape[1]):
        same &= ids[1:, col] == ids[:-1, col]
    if same.any():
        ids = ids[np.concatenate(([True], ~same))]
    return ids


class PackedTree:
    """A fixed-depth catalog as packed breadth-first tables (see the module docstring).

    Build with :meth:`from_items`. Attributes: ``depth``, ``n_items``, ``end_token_id``, ``vocab_size``,
    ``offsets``, ``codes``, ``level_states`` (the first state id of each depth ``0..depth``, then the end),
    ``level_edges`` (the first edge of each depth ``0..depth-1``, then the end), ``token_base`` (per depth).
    """

    __slots__ = ("depth", "n_items", "end_token_id", "vocab_size", "offsets", "codes", "level_states",
                 "level_edges", "token_base")

    root = 0

    def __init__(self, depth: int, offsets: np.ndarray, codes: np.ndarray, level_states: np.ndarray,
                 level_edges: np.ndarray, token_base: np.ndarray, end_token_id: int, vocab_size: int):
        self.depth = int(depth)
        self.offsets = offsets
        self.codes = codes
        self.level_states = level_states
        self.level_edges = level_edges
        self.token_base = token_base
        self.end_token_id = int(end_token_id)
        self.vocab_size = int(vocab_size)
        self.n_items = int(level_states[-1] - level_states[-2])
        for arr in (offsets, codes, level_states, level_edges, token_base):
            arr.setflags(write=False)

    # -- building ---------------------------------------------------------------------------------------------
    @classmethod
    def from_items(cls, ids, end_token_id: int, vocab_size: int) -> "PackedTree":
        """The tables of the items ``ids`` (an ``(items, depth)`` integer array, any order, duplicates allowed)."""
        ids = np.asarray(ids)
        if ids.ndim != 2 or ids.shape[1] < 1 or ids.shape[0] < 1:
            raise ValueError(f"items must be a non-empty (items, depth) array, got shape {ids.shape}")
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"token ids must lie in [0, {vocab_size})")
        if (ids == end_token_id).any():
            raise ValueError(f"an item contains the end token {end_token_id}")
        depth = ids.shape[1]
        ids = _sorted_unique_rows(ids.astype(np.int32, copy=False))
        n = ids.shape[0]
        # first[l]: the rows where a new path of length l + 1 starts (its state at depth l + 1 is new)
        new = np.zeros(n, dtype=bool)
        new[0] = True
        first: list[np.ndarray] = []
        for col in range(depth):
            if n > 1:
                new[1:] |= ids[1:, col] != ids[:-1, col]
            first.append(np.flatnonzero(new))
        counts = [1] + [f.size for f in first]  # states per depth 0..depth
        level_states = np.zeros(depth + 2, dtype=np.int64)
        np.cumsum(counts, out=level_states[1:])
        n_inner = int(level_states[depth])  # states with edges (depth < depth)
        n_edges = int(level_states[-1]) - 1
        off_dtype = np.uint32 if n_edges < 2**32 else np.int64
        offsets = np.empty(n_inner + 1, dtype=off_dtype)
        level_edges = np.zeros(depth + 1, dtype=np.int64)
        token_base = np.zeros(depth, dtype=np.int64)
        spans = []
        for level in range(depth):
            # the states of this depth start at the rows in `parents`; their edges are the new paths one longer
            parents = np.zeros(1, dtype=np.int64) if level == 0 else first[level - 1]
            children = first[level]
            start = int(level_states[level])
            edge0 = int(level_states[level + 1]) - 1  # edges into depth level + 1 are numbered as those states - 1
            level_edges[level] = edge0
            offsets[start : start + parents.size] = edge0 + np.searchsorted(children, parents)
            tok = ids[children, level]
            token_base[level] = int(tok.min())
            spans.append(int(tok.max()) - int(tok.min()))
        level_edges[depth] = n_edges
        offsets[n_inner] = n_edges
        code_dtype = np.uint16 if max(spans) < 2**16 else np.int32
        codes = np.empty(n_edges, dtype=code_dtype)
        for level in range(depth):
            tok = ids[first[level], level].astype(np.int64) - token_base[level]
            codes[level_edges[level] : level_edges[level + 1]] = tok
        return cls(depth, offsets, codes, level_states, level_edges, token_base, end_token_id, vocab_size)

    # -- sizes --------------------------------------------------------------------------------------------------
    @property
    def n_states(self) -> int:
        return int(self.level_states[-1])

    @property
    def n_edges(self) -> int:
        return int(self.codes.size)

    @property
    def nbytes(self) -> int:
        return int(self.offsets.nbytes + self.codes.nbytes + self.level_states.nbytes + self.level_edges.nbytes
                   + self.token_base.nbytes)

    # -- one state ----------------------------------------------------------------------------------------------
    @property
    def n_inner(self) -> int:
        """The number of states (every state has edges; after an item's last token a row is at ``LEAF``)."""
        return int(self.level_states[self.depth])

    @property
    def last_edges(self) -> int:
        """The first edge of the last level: edges from here on lead to ``LEAF``."""
        return int(self.level_edges[self.depth - 1])

    def _level(self, state: int) -> int:
        return int(np.searchsorted(self.level_states, state, side="right")) - 1

    def allowed(self, state: int) -> np.ndarray:
        """The tokens of ``state``'s edges, ascending (empty for ``LEAF``/``DONE``, where the end token alone is
        allowed, as in ``MaskTables``)."""
        if not 0 <= state < self.n_inner:
            return np.zeros(0, dtype=np.int32)
        lo, hi = int(self.offsets[state]), int(self.offsets[state + 1])
        return self.codes[lo:hi].astype(np.int32) + np.int32(self.token_base[self._level(state)])

    def step(self, state: int, token: int) -> int:
        """The state after ``token`` (as ``MaskTables.step``): ``DONE`` after the end token, ``LEAF`` for a token
        without an edge and after an item's last token."""
        if state == DONE or token == self.end_token_id:
            return DONE
        if not 0 <= state < self.n_inner or not 0 <= token < self.vocab_size:
            return LEAF
        lo, hi = int(self.offsets[state]), int(self.offsets[state + 1])
        code = token - int(self.token_base[self._level(state)])
        if code < 0:
            return LEAF
        i = lo + int(self.codes[lo:hi].searchsorted(code))
        if i < hi and int(self.codes[i]) == code:
            return i + 1 if i < self.last_edges else LEAF
        return LEAF

    # -- many rows at once --------------------------------------------------------------------------------------
    def levels(self, states: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.level_states, states, side="right") - 1

    def children(self, states: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every edge of every state in ``states`` (states, not ``LEAF``/``DONE``): ``(row, token, next_state)``,
        rows in order and tokens ascending within a row: the beam step's gather."""
        states = np.asarray(states, dtype=np.int64)
        lo = self.offsets[states].astype(np.int64)
        lens = self.offsets[states + 1].astype(np.int64) - lo
        ends = np.cumsum(lens)
        total = int(ends[-1]) if ends.size else 0
        row = np.repeat(np.arange(states.size, dtype=np.int64), lens)
        edge = np.arange(total, dtype=np.int64) + np.repeat(lo + lens - ends, lens)
        lv = self.levels(states)
        if lv.size and lv.min() == lv.max():  # the usual case: a beam request's rows are all at one depth
            level = int(lv[0])
            token = self.codes[edge].astype(np.int64)
            token += self.token_base[level]
            nxt = edge + 1 if level < self.depth - 1 else np.full(edge.size, LEAF, dtype=np.int64)
            return row, token, nxt
        token = self.codes[edge].astype(np.int64) + self.token_base[np.repeat(lv, lens)]
        nxt = np.where(edge < self.last_edges, edge + 1, LEAF)
        return row, token, nxt

    def advance(self, states: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """:meth:`step` of many rows at once: a bisection inside each row's own edges, all rows together."""
        states = np.asarray(states, dtype=np.int64)
        tokens = np.asarray(tokens, dtype=np.int64)
        out = np.full(states.size, LEAF, dtype=np.int64)
        out[(tokens == self.end_token_id) | (states == DONE)] = DONE
        live = np.flatnonzero((states >= 0) & (states < self.n_inner) & (out == LEAF))
        if not live.size:
            return out
        s = states[live]
        code = tokens[live] - self.token_base[self.levels(s)]
        lo = self.offsets[s].astype(np.int64)
        hi = self.offsets[s + 1].astype(np.int64)
        if s.size > 1 and s.min() == s.max():  # every row in one state (a beam request's first step): one search
            pos = lo + np.searchsorted(self.codes[int(lo[0]) : int(hi[0])], np.maximum(code, 0))
        else:
            pos = self._lower_bound(lo, hi, code)
        last = self.codes.size - 1
        hit = (pos < hi) & (self.codes[np.minimum(pos, last)].astype(np.int64) == code) & (code >= 0)
        out[live[hit]] = np.where(pos[hit] < self.last_edges, pos[hit] + 1, LEAF)
        return out

    def _lower_bound(self, lo: np.ndarray, hi: np.ndarray, code: np.ndarray) -> np.ndarray:
        """The first position of ``codes[lo:hi]`` not below ``code``, for every row at once (a bisection)."""
        codes = self.codes
        last = codes.size - 1
        count = hi - lo
        while count.max() > 0:
            half = count >> 1
            mid = lo + half
            go = (count > 0) & (codes[np.minimum(mid, last)] < code)
            lo = np.where(go, mid + 1, lo)
            count = np.where(go, count - half - 1, half)
        return lo

    def item_count(self, states: np.ndarray) -> np.ndarray:
        """How many items end below each state (as ``MaskTables.item_count``)."""
        states = np.asarray(states, dtype=np.int64)
        lvl = self.levels(states)
        lo, hi = states.copy(), states + 1
        for level in range(self.depth - 1):  # the states below form one contiguous range per depth
            at = lvl == level
            if at.any():
                lo[at] = self.offsets[lo[at]].astype(np.int64) + 1
                hi[at] = self.offsets[hi[at]].astype(np.int64) + 1
                lvl[at] = level + 1
        return self.offsets[hi].astype(np.int64) - self.offsets[lo].astype(np.int64)

    def min_remaining(self, states: np.ndarray) -> np.ndarray:
        """The tokens a row in each state still emits, the end token included (``LEAF``: 1, ``DONE``: 0)."""
        states = np.asarray(states, dtype=np.int64)
        lvl = self.levels(np.maximum(states, 0))
        return np.where(states == DONE, 0, np.where(states < 0, 1, self.depth + 1 - lvl))
