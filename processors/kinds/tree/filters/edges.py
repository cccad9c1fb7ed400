"""Each item's terminal in the tables, and a filter's answer over the whole tables at once.

Each item's *terminal* (the edge that ends it, or ``n_edges + state`` for an item that ends in a state without edges)
is computed once per version (:func:`item_terminals`): the filter index places each item's metadata by it
(:class:`processors.kinds.tree.filters.slots.SlotIndex`).

The rest is the whole-tables form of a resolved filter, which the service no longer builds (it resolves lazily:
:mod:`processors.kinds.tree.filters.lazy`); the tests and ``bench/filters.py`` compare against it. Given a boolean
per item, :func:`passing_counts` walks up from the passing items' terminals (through each state's parent edge,
:class:`TreeParents`) to the count per state and a ``bool`` per edge, :func:`filter_book` makes that a
:class:`~processors.items.DenseBook`, and :func:`edge_mask` is the same per-edge answer computed top-down over the
tree's levels (:class:`TreeLevels`).
"""

from __future__ import annotations

import numpy as np

from processors.items import DenseBook
from processors.tables import LEAF, MaskTables, item_metrics
from processors.kinds.tree.tables.overlay import overlay_base

__all__ = ["TreeLevels", "TreeParents", "edge_mask", "filter_book", "item_terminals", "passing_counts"]


def _kept_on(tables: MaskTables, key: str, build):
    """``build(tables)``, made once and kept on the (immutable, frozen) tables under ``key``."""
    cached = tables.__dict__.get(key)
    if cached is None:
        cached = build(tables)
        object.__setattr__(tables, key, cached)
    return cached


class TreeParents:
    """Each edge's source state and each state's parent edge (the edge that leads into it; ``-1`` for the root and
    states no edge leads to): what a walk from the items' terminals up to the root reads."""

    def __init__(self, tables: MaskTables):
        counts = np.diff(tables.offsets)
        self.edge_source = np.repeat(np.arange(tables.n_states, dtype=np.int64), counts)
        self.parent_edge = np.full(tables.n_states, -1, dtype=np.int64)
        nxt = tables.next_state.astype(np.int64)
        inner = np.flatnonzero(nxt >= 0)
        base_edges = overlay_base(tables).n_edges
        # every state has one edge into it, except under an overlay version (processors/kinds/tree/tables/overlay.py): a
        # state below a touched path is also the target of its superseded parents' edges; the latest copy's edge,
        # appended last, is the one a walk from the root takes
        first = inner[inner < base_edges]
        self.parent_edge[nxt[first]] = first
        later = inner[inner >= base_edges]
        if later.size:
            np.maximum.at(self.parent_edge, nxt[later], later)

    @classmethod
    def of(cls, tables: MaskTables) -> "TreeParents":
        """The parents of ``tables``, computed once and kept on them (tables are immutable)."""
        return _kept_on(tables, "_filter_parents", cls)


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
        return _kept_on(tables, "_filter_levels", cls)


def item_terminals(tables: MaskTables, flat: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The terminal of each item (``flat`` / ``lengths``: the items' token ids after the root, without the end token,
    as a catalog holds them), walked through the tables with one batched search per token position; ``-1`` for an
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
    for pos in range(int(lengths.max(initial=0))):
        rows = np.flatnonzero(alive & (lengths > pos))
        if not rows.size:
            break
        s = state[rows]
        bad = s < 0  # a token after a LEAF edge: no such item
        idx = tables.find_edges(s, flat[starts[rows] + pos])  # (-1 where s is LEAF: no such item)
        found = (idx >= 0) & ~bad
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
        idx = tables.find_edges(si, np.full(si.size, tables.end_token_id, dtype=np.int64))
        t = np.where(empty, tables.n_edges + si, idx)
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


def passing_counts(tables: MaskTables, terminals: np.ndarray, passing: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(count per state, bool per terminal, bool per edge)``: how many items that pass lie below each state (the
    state's own item included), which terminals end an item that passes (``n_edges + n_states`` entries, as
    :func:`edge_mask`), and which edges lie on the way to (or end) such an item (:func:`edge_mask`'s answer). The
    item controls' books count items so (:class:`processors.items.DenseBook`). A walk up from the passing items'
    terminals: its cost follows those items (and their depth), plus a few passes over the states."""
    n_edges = tables.n_edges
    term_ok = np.zeros(n_edges + tables.n_states, dtype=bool)
    t = terminals[passing]
    t = t[t >= 0]
    term_ok[t] = True
    edge_ok = term_ok[:n_edges].copy()  # a terminal edge is open when its item passes; the others below
    parents = TreeParents.of(tables)
    on_edge = t < n_edges
    state = np.empty(t.size, dtype=np.int64)  # the state each item's terminal hangs from
    state[on_edge] = parents.edge_source[t[on_edge]]
    state[~on_edge] = t[~on_edge] - n_edges
    path_states = [state]
    while state.size:
        up = parents.parent_edge[state]
        up = up[up >= 0]
        edge_ok[up] = True
        state = parents.edge_source[up]
        path_states.append(state)
    count = np.bincount(np.concatenate(path_states), minlength=tables.n_states).astype(np.int64)
    return count, term_ok, edge_ok


def filter_book(tables: MaskTables, terminals: np.ndarray, passing: np.ndarray) -> DenseBook:
    """The items a filter leaves out as a :class:`~processors.items.DenseBook` (the item controls then treat them as
    excluded: ``n``, ``distinct``, the token budget and multi-item rows all count the items that pass)."""
    count, term_ok, edge_ok = passing_counts(tables, terminals, passing)
    return DenseBook(item_metrics(tables)[1].astype(np.int64) - count, ~term_ok, (tables, edge_ok))
