"""What a resolved filter means for the decode step: a boolean per edge of the served tables.

A filter (:mod:`.filters`) passes some of the catalog's items. A row may take an edge only while an item that passes
lies below it (or the edge ends such an item): :func:`edge_mask` gives that ``bool`` per edge, so a step's work is
one gather per row (``edge_ok[offsets[s]:offsets[s+1]]``), whatever the catalog's size or the filter's clauses.

It is computed with array passes, bottom-up over the tree's levels: each item's *terminal* (the edge that ends it,
or ``n_edges + state`` for an item that ends in a state without edges) is marked when the item passes; an edge into
a state is allowed when any edge out of that state is, or an item ends in it. The levels and the items' terminals
depend on the tables alone and are computed once per tables (:class:`TreeLevels`, :func:`item_terminals`).
"""

from __future__ import annotations

import numpy as np

from processors.items import DenseBook
from processors.tables import LEAF, MaskTables, item_metrics

__all__ = ["TreeLevels", "edge_mask", "filter_book", "item_terminals", "passing_counts"]


class TreeLevels:
    """The states reachable from the root, level by level: per level its states, their edges (one after the other,
    as a gather of the CSR) and where each state's edges start in that list."""

    def __init__(self, tables: MaskTables):
        offsets, nxt = tables.offsets, tables.next_state
        counts = np.diff(offsets)
        self.levels: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        frontier = np.array([tables.root], dtype=np.int64) if tables.root >= 0 else np.zeros(0, dtype=np.int64)
        seen = np.zeros(tables.n_states, dtype=bool)
        while frontier.size:
            seen[frontier] = True
            c = counts[frontier]
            starts = np.zeros(frontier.size, dtype=np.int64)
            np.cumsum(c[:-1], out=starts[1:])
            edges = np.repeat(offsets[frontier] - starts, c) + np.arange(int(c.sum()), dtype=np.int64)
            self.levels.append((frontier, edges, starts))
            target = nxt[edges].astype(np.int64)
            target = np.unique(target[target >= 0])
            frontier = target[~seen[target]]

    @classmethod
    def of(cls, tables: MaskTables) -> "TreeLevels":
        """The levels of ``tables``, computed once and kept on them (tables are immutable)."""
        cached = tables.__dict__.get("_filter_levels")
        if cached is None:
            cached = cls(tables)
            object.__setattr__(tables, "_filter_levels", cached)
        return cached


def item_terminals(tables: MaskTables, flat: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The terminal of each item (``flat`` / ``lengths``: the items' token ids after the root, without the end token,
    as a catalog holds them), walked through the tables with one ``searchsorted`` per token position; ``-1`` for an
    item that is not in the tables."""
    n = lengths.size
    out = np.full(n, -1, dtype=np.int64)
    if tables.root < 0 or not n:
        return out
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    state = np.full(n, tables.root, dtype=np.int64)
    last_edge = np.full(n, -1, dtype=np.int64)
    alive = np.ones(n, dtype=bool)
    keys, base = tables.keys, tables.key_base
    for pos in range(int(lengths.max(initial=0))):
        rows = np.flatnonzero(alive & (lengths > pos))
        if not rows.size:
            break
        s = state[rows]
        bad = s < 0  # a token after a LEAF edge: no such item
        key = s * base + flat[starts[rows] + pos]
        idx = np.minimum(np.searchsorted(keys, key), keys.size - 1)
        found = (keys[idx] == key) & ~bad
        alive[rows[~found]] = False
        rows, idx = rows[found], idx[found]
        last_edge[rows] = idx
        state[rows] = tables.next_state[idx]
    ok = np.flatnonzero(alive)
    s, e = state[ok], last_edge[ok]
    term = np.full(ok.size, -1, dtype=np.int64)
    leaf = s == LEAF
    term[leaf] = e[leaf]
    inner = s >= 0
    if inner.any():
        si = s[inner]
        empty = tables.offsets[si + 1] == tables.offsets[si]
        end_key = si * base + tables.end_token_id
        idx = np.minimum(np.searchsorted(keys, end_key), keys.size - 1)
        has_end = keys[idx] == end_key
        t = np.where(empty, tables.n_edges + si, np.where(has_end, idx, -1))
        term[inner] = t
    out[ok] = term
    return out


def edge_mask(tables: MaskTables, terminals: np.ndarray, passing: np.ndarray) -> np.ndarray:
    """``bool`` per edge: the edge is on the way to (or ends) an item that passes. ``terminals``: each item's
    (:func:`item_terminals`); ``passing``: ``bool`` per item. Also gives, past the edges, one entry per state: an
    item that passes ends in that state without edges."""
    n_edges = tables.n_edges
    term_ok = np.zeros(n_edges + tables.n_states, dtype=bool)
    t = terminals[passing]
    term_ok[t[t >= 0]] = True
    edge_ok = term_ok  # the terminal edges start as themselves; inner edges are set below
    alive = np.zeros(tables.n_states, dtype=bool)
    nxt = tables.next_state
    for states, edges, starts in reversed(TreeLevels.of(tables).levels):
        if edges.size:
            target = nxt[edges].astype(np.int64)
            inner = target >= 0
            ok = term_ok[edges]
            ok[inner] = alive[target[inner]]
            edge_ok[edges] = ok
            has = np.diff(np.append(starts, edges.size)) > 0
            reach = np.zeros(states.size, dtype=bool)
            if has.any():
                reach[has] = np.logical_or.reduceat(ok, starts[has])
            alive[states] = reach | term_ok[n_edges + states]
        else:
            alive[states] = term_ok[n_edges + states]
    return edge_ok


def passing_counts(tables: MaskTables, terminals: np.ndarray, passing: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(count per state, bool per terminal)``: how many items that pass lie below each state (the state's own
    item included), and which terminals end an item that passes (``n_edges + n_states`` entries, as
    :func:`edge_mask`). The item controls' books count items so (:class:`processors.items.DenseBook`)."""
    n_edges = tables.n_edges
    term_ok = np.zeros(n_edges + tables.n_states, dtype=bool)
    t = terminals[passing]
    term_ok[t[t >= 0]] = True
    count = np.zeros(tables.n_states, dtype=np.int64)
    nxt = tables.next_state
    for states, edges, starts in reversed(TreeLevels.of(tables).levels):
        own = term_ok[n_edges + states].astype(np.int64)
        if edges.size:
            target = nxt[edges].astype(np.int64)
            per_edge = term_ok[edges].astype(np.int64)
            inner = target >= 0
            per_edge[inner] = count[target[inner]]
            has = np.diff(np.append(starts, edges.size)) > 0
            if has.any():
                own[has] += np.add.reduceat(per_edge, starts[has])
        count[states] = own
    return count, term_ok


def filter_book(tables: MaskTables, terminals: np.ndarray, passing: np.ndarray) -> DenseBook:
    """The items a filter leaves out as a :class:`~processors.items.DenseBook` (the item controls then treat them as
    excluded: ``n``, ``distinct``, the token budget and multi-item rows all count the items that pass)."""
    count, term_ok = passing_counts(tables, terminals, passing)
    return DenseBook(item_metrics(tables)[1].astype(np.int64) - count, ~term_ok)
