"""A catalog's tables after a delta, updated along the changed paths only (``PATCH /admin/scenarios/{name}``).

:func:`patch_tables` takes the tables of a catalog as :func:`~processors.kinds.tree.tables.compile.catalog_tables` builds them
(the trie's nodes with a continuation are the states, numbered in preorder: a prefix before its extensions,
siblings by token) and the items added and removed, and gives the tables :func:`catalog_tables` would build from
the new item set: **byte for byte the same arrays** (``offsets``, ``tokens``, ``next_state``, ``root``,
so the same ``version``) and the same item metrics (``min_remaining``, ``item_count``, ``uniform``, ``deepest``).
``tests/unit/test_tree_delta.py`` checks this against a full compile over random catalogs and sequences of deltas.

The work follows the delta, not the catalog:

* the *touched* paths are the prefixes of the added and removed items; only they can change. They are numbered
  once (one pass over the delta's items in Python), then handled as arrays over those numbers a depth at a time:
  looked up in the old tables (one batched search per depth, ``MaskTables.find_edges``), their new children and end
  flags settled deepest first (a node without an item below it any more is dropped, an old leaf that gains an
  extension becomes a state);
* a new state's place is its preorder rank among the old states (the first old state after its path), so the
  old states keep their order and the new ones go in between: a state's new number is its old one, less the
  removed states before it, plus the new states before it (array passes over the states, no sort);
* the edges of untouched states are copied (one masked copy per array: they keep their order) with their targets
  renumbered; the touched states' edges are their old ones edited and their new children's, built and sorted
  together; the item metrics of untouched states are copied (their subtrees did not change) and those of touched
  states recomputed, deepest first, a depth at a time.

Every array is still copied once (the tables are immutable and shared with the replicas): copies and gathers over
all states and edges, a few milliseconds per million, against the sorts of a full compile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from config.cancel import checkpoint

from processors.tables import _UNSET, DONE, LEAF, MaskTables, _freeze, item_metrics

__all__ = ["Touched", "max_remaining", "patch_tables", "settle"]

_INT32_MAX = np.iinfo(np.int32).max

ABSENT = -3  # a touched path that is not a node of the old trie

_SCAN = 4  # edges looked at one by one (all queries at once) for the first child state by a larger token


def max_remaining(tables: MaskTables) -> np.ndarray:
    """The longest way to an end per state (end token included): kept by :func:`item_metrics` where the tables
    were built (it does not travel with pickled tables); computed again when missing."""
    cached = tables.__dict__.get("_max_remaining")
    if cached is None and "_max_tail" in tables.__dict__:  # an unpickled overlay (processors/kinds/tree/tables/overlay.py)
        from processors.kinds.tree.tables.stacked import Stacked

        cached = Stacked(max_remaining(tables.__dict__["overlay_base"]), tables.__dict__["_max_tail"])
        object.__setattr__(tables, "_max_remaining", cached)
    if cached is None:
        from processors.tables import _item_metrics

        _item_metrics(tables)  # stores it
        cached = tables.__dict__.get("_max_remaining")
        if cached is None:  # no states
            cached = np.zeros(0, dtype=np.int32)
    return cached


class _Old:
    """Lookups in the old tables, batched: one search for many edges at once (``MaskTables.find_edges``; a scalar
    lookup costs a few microseconds of numpy call and cache misses; thousands of them were most of a small delta)."""

    def __init__(self, tables: MaskTables):
        self.t = tables
        self.offsets, self.nxt = tables.offsets, tables.next_state

    def targets(self, states: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """The targets of the edges ``states[i] --tokens[i]-->`` (int64: a state, ``LEAF`` or ``DONE``), ``ABSENT``
        without that edge (and where ``states[i]`` is not a state)."""
        out = np.full(states.size, ABSENT, dtype=np.int64)
        if not states.size or not self.t.n_edges:
            return out
        at = self.t.find_edges(states, tokens)
        hit = at >= 0
        out[hit] = self.nxt[at[hit]]
        return out

    def first_states_after(self, paths: np.ndarray, parent: np.ndarray, token: np.ndarray,
                           node: np.ndarray) -> np.ndarray:
        """For each touched path ``paths[i]`` under an old state (``parent``, ``token``, ``node``: the touched
        paths' parents, last tokens and old nodes): the first old state in preorder after every path ``parent +
        (t, ...)`` with ``t <= token``: the first child state of the parent by a larger token, else the same
        question one level up (the first state after the parent's subtree), else ``n_states``. All paths one level
        at a time."""
        n_edges, result = self.t.n_edges, np.full(paths.size, self.t.n_states, dtype=np.int64)
        at_path, which = paths, np.arange(paths.size)
        while at_path.size:
            states = node[parent[at_path]]
            at = self.t.locate(states, token[at_path], side="right")  # by a larger token
            hi = self.offsets[states + 1]
            found = np.full(states.size, -1, dtype=np.int64)
            for _ in range(_SCAN):  # the first of those edges that leads to a state: mostly the first one
                open_ = (found < 0) & (at < hi)
                if not open_.any():
                    break
                is_state = open_ & (self.nxt[np.minimum(at, n_edges - 1)] >= 0)
                found[is_state] = self.nxt[at[is_state]]
                at = np.where(open_ & ~is_state, at + 1, at)
            for j in np.flatnonzero((found < 0) & (at < hi)).tolist():  # a long run of leaf edges: one scan
                later = np.flatnonzero(self.nxt[at[j]:hi[j]] >= 0)
                if later.size:
                    found[j] = self.nxt[at[j] + later[0]]
            hit = found >= 0
            result[which[hit]] = found[hit]
            at_path, which = parent[at_path[~hit]], which[~hit]  # one level up, to the root (nothing after it)
            up = at_path != 0
            at_path, which = at_path[up], which[up]
        return result


def patch_tables(tables: MaskTables, add: Iterable[Sequence[int]], remove: Iterable[Sequence[int]]) -> MaskTables | None:
    """The tables of the catalog ``tables`` was built from, with ``add`` added and ``remove`` removed (an add
    already present and a remove not present are no-ops), equal to :func:`~processors.kinds.tree.tables.compile.catalog_tables`
    of the new items (see the module). ``tables`` must be a catalog's tables in that form (states in preorder).
    ``None`` where the old tables cannot tell their items (no state: an empty catalog and the catalog of the empty
    item give the same tables): the caller compiles the new items in full."""
    if tables.root < 0:
        return None
    touched = settle(tables, add, remove)
    if touched is None:
        return tables
    parent, token, node, is_state = touched.parent, touched.token, touched.node, touched.is_state
    is_old = node >= 0
    old = _Old(tables)
    removed = np.sort(node[is_old & ~is_state])
    modified = np.flatnonzero(is_state & is_old)
    # a new state's rank (old states before it): the first old state after its path; a new state under a new state
    # has its parent's
    new = is_state & ~is_old
    new[0] = False
    rank = np.zeros(node.size, dtype=np.int64)
    top = new & is_old[np.maximum(parent, 0)]  # under an old state (touched, and so are its ancestors)
    tops = np.flatnonzero(top)
    rank[tops] = old.first_states_after(tops, parent, token, node)
    for level in touched.levels[2:]:
        below = level[new[level] & ~top[level]]
        rank[below] = rank[parent[below]]
    paths, ranks = touched.paths, rank.tolist()  # the new states in preorder: by rank, then by path
    fresh = np.array(sorted(np.flatnonzero(new).tolist(), key=lambda i: (ranks[i], paths[i])), dtype=np.int64)
    checkpoint()
    plan = _Plan(tables, parent, token, touched.depth, node, touched.alive, is_state, touched.was_end,
                 touched.new_end, removed, modified, fresh, rank[fresh])
    return plan.assemble()


@dataclass(slots=True)
class Touched:
    """The touched paths of a delta (every prefix of an added or removed item; the root is path 0) as arrays over
    their numbers, settled against the old tables: ``parent``, ``token`` (the last), ``depth``, ``levels`` (the
    paths of each depth), ``node`` (the old state, ``LEAF`` or ``ABSENT``), ``was_end`` / ``new_end`` (an item
    ends there before / after), ``alive`` (still a node of the trie), ``is_state`` (a node with children after),
    ``is_add`` / ``is_remove`` (an item the delta really adds / removes: not there / there before), ``paths`` (each
    number's path, a tuple)."""

    paths: list
    parent: np.ndarray
    token: np.ndarray
    depth: np.ndarray
    levels: list
    node: np.ndarray
    was_end: np.ndarray
    new_end: np.ndarray
    alive: np.ndarray
    is_state: np.ndarray
    is_add: np.ndarray
    is_remove: np.ndarray


def settle(tables: MaskTables, add: Iterable[Sequence[int]], remove: Iterable[Sequence[int]]) -> Touched | None:
    """The touched paths of ``add`` / ``remove`` on ``tables`` (a catalog's, ``root >= 0``), looked up in the old
    tables and settled deepest first; ``None`` when the delta changes nothing (every add there, every remove not)."""
    end = tables.end_token_id
    old = _Old(tables)
    adds = {tuple(int(t) for t in item) for item in add}
    removes = {tuple(int(t) for t in item) for item in remove}
    # the touched paths: every prefix of an add or remove, numbered as first met (the root is 0); from here on
    # arrays over those numbers: parent, last token, depth
    index: dict[tuple[int, ...], int] = {(): 0}
    parents, tokens, depths = [-1], [end], [0]  # (the root's token is never read)
    for item in adds | removes:
        at = 0
        for d in range(1, len(item) + 1):
            path = item[:d]
            k = index.get(path)
            if k is None:
                k = index[path] = len(parents)
                parents.append(at)
                tokens.append(item[d - 1])
                depths.append(d)
            at = k
    n = len(parents)
    parent = np.array(parents, dtype=np.int64)
    token = np.array(tokens, dtype=np.int64)
    depth = np.array(depths, dtype=np.int64)
    by_depth = np.argsort(depth, kind="stable")
    bounds = np.searchsorted(depth[by_depth], np.arange(int(depth.max()) + 2))
    levels = [by_depth[bounds[d]:bounds[d + 1]] for d in range(bounds.size - 1)]  # the paths of each depth
    # each path's old node: a state, LEAF (an old leaf) or ABSENT; looked up a depth at a time
    node = np.full(n, ABSENT, dtype=np.int64)
    node[0] = tables.root
    for level in levels[1:]:
        found = old.targets(node[parent[level]], token[level])
        found[found == DONE] = ABSENT
        node[level] = found
    # the old item set has the path: an old leaf, or a state with an end-token edge
    was_end = (node == LEAF) | (old.targets(node, np.full(n, end, dtype=np.int64)) == DONE)
    is_add = np.zeros(n, dtype=bool)
    is_add[[index[p] for p in adds]] = True
    is_add &= ~was_end  # (no-ops: an add already there, a remove not there)
    is_remove = np.zeros(n, dtype=bool)
    is_remove[[index[p] for p in removes]] = True
    is_remove &= was_end
    if not is_add.any() and not is_remove.any():
        return None
    checkpoint()
    # settle the touched paths deepest first: end flag, number of children, is it still there (a depth at a time:
    # a path's children are one depth below it)
    new_end = (was_end | is_add) & ~is_remove
    is_old = node >= 0
    old_at = np.where(is_old, node, 0)
    n_children = np.where(is_old, tables.offsets[old_at + 1] - tables.offsets[old_at] - was_end, 0)
    alive = np.zeros(n, dtype=bool)
    is_state = np.zeros(n, dtype=bool)
    absent = node == ABSENT
    for d in range(len(levels) - 1, -1, -1):
        level = levels[d]
        is_state[level] = n_children[level] > 0
        alive[level] = is_state[level] | new_end[level] | (d == 0)  # (the root stays)
        if d:  # a child that appears, or one of the old trie that is gone
            np.add.at(n_children, parent[level],
                      (alive[level] & absent[level]).astype(np.int64) - (~alive[level] & ~absent[level]))
    return Touched(list(index), parent, token, depth, levels, node, was_end, new_end, alive, is_state, is_add, is_remove)


class _Plan:
    """The new tables from the settled touched paths (see the module); arrays over the touched paths' numbers."""

    def __init__(self, tables, parent, token, depth, node, alive, is_state, was_end, new_end, removed, modified,
                 fresh, ranks):
        self.t, self.parent, self.token, self.depth, self.node = tables, parent, token, depth, node
        self.alive, self.is_state, self.was_end, self.new_end = alive, is_state, was_end, new_end
        n_old = tables.n_states
        # old state i becomes i - (removed states before i) + (new states ranked at or before i): one cumsum of the
        # steps (1 per state, +1 per new state ranked there, -1 after a removed one), no search per state
        step = np.ones(n_old + 1, dtype=np.int64)
        step[0] = 0
        np.add.at(step, ranks, 1)
        np.subtract.at(step, removed + 1, 1)
        self.new_of_old = np.cumsum(step, out=step)[:n_old]
        self.n_new = n_old - removed.size + ranks.size
        # each touched path's new state number (-1: not a state)
        self.new_id = np.full(node.size, -1, dtype=np.int64)
        self.new_id[fresh] = ranks - removed.searchsorted(ranks) + np.arange(ranks.size, dtype=np.int64)
        self.new_id[modified] = self.new_of_old[node[modified]]
        self.mod_ids = np.sort(node[modified])
        self.copy = np.ones(n_old, dtype=bool)  # the old states copied as they are: neither removed nor touched
        self.copy[removed] = False
        self.copy[self.mod_ids] = False

    def touched_edges(self, built: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The new edges of the touched states (paths ``built``, by new number) as ``(counts, keys, tokens,
        targets)``, the edges sorted by key (by state, then token), ``counts`` per state: a modified state's old
        edges renumbered, less those to children that are gone (and its end edge where it no longer ends an item),
        with its touched children's targets set; plus the edges to children that are new and the new end edges.
        Array passes over the touched paths and the modified states' old edges (a wide state has thousands)."""
        t, end, base = self.t, self.t.end_token_id, np.int64(self.t.vocab_size)
        node, alive, is_state, new_id, parent = self.node, self.alive, self.is_state, self.new_id, self.parent
        # the touched children of the touched states: appear (a new edge), stay (their edge's target set) or go
        child = np.arange(1, node.size)
        child = child[is_state[parent[child]]]
        up = parent[child]
        target = np.where(is_state[child], new_id[child], LEAF)
        was = node[child] != ABSENT  # (every child of a new state is ABSENT)
        appear, stay, gone = ~was & alive[child], was & alive[child], was & ~alive[child]
        # the end edges that appear or go
        end_in = self.new_end[built] & ((node[built] < 0) | ~self.was_end[built])
        end_out = (node[built] >= 0) & self.was_end[built] & ~self.new_end[built]
        # the modified states' old edges (ascending: the states are), renumbered, then edited where a touched
        # child's key finds them
        mod = self.mod_ids
        lo = t.offsets[mod]
        counts = t.offsets[mod + 1] - lo
        firsts = np.zeros(mod.size, dtype=np.int64)
        np.cumsum(counts[:-1], out=firsts[1:])
        edges = np.repeat(lo - firsts, counts) + np.arange(int(counts.sum()), dtype=np.int64)
        states = np.repeat(self.new_of_old[mod], counts)
        tokens = t.tokens[edges].astype(np.int64)
        targets = t.next_state[edges].astype(np.int64)
        inner = targets >= 0
        targets[inner] = self.new_of_old[targets[inner]]
        keep = np.ones(edges.size, dtype=bool)
        if stay.any():
            at = edges.searchsorted(t.find_edges(node[up[stay]], self.token[child[stay]]))
            targets[at] = target[stay]
        drop_states = np.concatenate((node[up[gone]], node[built[end_out]]))
        if drop_states.size:
            drop_tokens = np.concatenate((self.token[child[gone]], np.full(int(end_out.sum()), end, dtype=np.int64)))
            keep[edges.searchsorted(t.find_edges(drop_states, drop_tokens))] = False
        n_end = int(end_in.sum())
        states = np.concatenate((states[keep], new_id[up[appear]], new_id[built[end_in]]))
        tokens = np.concatenate((tokens[keep], self.token[child[appear]], np.full(n_end, end, dtype=np.int64)))
        targets = np.concatenate((targets[keep], target[appear], np.full(n_end, DONE, dtype=np.int64)))
        keys = states * base + tokens
        order = np.argsort(keys, kind="stable")
        keys, tokens, targets, states = keys[order], tokens[order], targets[order], states[order]
        built_ids = new_id[built]
        counts = states.searchsorted(built_ids, side="right") - states.searchsorted(built_ids)
        return counts, keys, tokens, targets

    def assemble(self) -> MaskTables:
        t, n_new = self.t, self.n_new
        built = np.flatnonzero(self.new_id >= 0)  # the touched states, by new number
        built = built[np.argsort(self.new_id[built])]
        built_ids = self.new_id[built]
        built_counts, built_keys, built_tokens, built_targets = self.touched_edges(built)
        checkpoint()
        # The copied old states keep their order, and so do their edges: in the new arrays they fill, in order,
        # every place the touched states do not take. So each array is one masked copy (the copied states' values,
        # or their edges') and one scatter of the touched states' values, with no loop over the runs between
        # touched states (thousands of them for a 2,000-item delta).
        copy = self.copy
        old_counts = np.diff(t.offsets)
        touched_state = np.zeros(n_new, dtype=bool)
        touched_state[built_ids] = True
        counts = np.empty(n_new, dtype=np.int64)
        counts[~touched_state] = old_counts[copy]
        counts[built_ids] = built_counts
        offsets = np.empty(n_new + 1, dtype=np.int64)
        offsets[0] = 0
        np.cumsum(counts, out=offsets[1:])
        n_edges = int(offsets[-1])
        copied_edge = np.repeat(copy, old_counts)  # the old edges of copied states
        del old_counts
        firsts = np.zeros(built_ids.size, dtype=np.int64)
        np.cumsum(built_counts[:-1], out=firsts[1:])
        touched_at = np.repeat(offsets[built_ids] - firsts, built_counts) + np.arange(built_keys.size, dtype=np.int64)
        other_edges = np.ones(n_edges, dtype=bool)
        other_edges[touched_at] = False
        tokens = np.empty(n_edges, dtype=np.int32)
        tokens[other_edges] = t.tokens[copied_edge]
        tokens[touched_at] = built_tokens
        # every old target renumbered at once (a lookup table, LEAF and DONE at its end: indices -1 and -2)
        lut = np.empty(t.n_states + 2, dtype=np.int32)
        lut[:-2] = self.new_of_old
        lut[LEAF], lut[DONE] = LEAF, DONE
        nxt = np.empty(n_edges, dtype=np.int32)
        nxt[other_edges] = lut.take(t.next_state[copied_edge])
        nxt[touched_at] = built_targets
        del lut, copied_edge, other_edges
        del counts
        # the copied states' item metrics (their subtrees are unchanged); the touched ones' are computed below
        old_min, old_items, _, _ = item_metrics(t)
        old_max = max_remaining(t)
        copied_state = ~touched_state
        min_rem = np.empty(n_new, dtype=np.int32)
        max_rem = np.empty(n_new, dtype=np.int32)
        items = np.empty(n_new, dtype=np.int32)
        min_rem[copied_state] = old_min[copy]
        max_rem[copied_state] = old_max[copy]
        items[copied_state] = old_items[copy]
        checkpoint()
        root = int(self.new_id[0]) if self.is_state[0] else LEAF
        metrics, max_rem = self.metrics(min_rem, max_rem, items, offsets, nxt, built)
        return MaskTables.assemble(offsets, tokens, nxt, root, t.end_token_id, t.vocab_size, metrics, max_rem)

    def metrics(self, min_rem, max_rem, items, offsets, nxt, built):
        """The item metrics of the new tables, given those of the untouched states (copied: their subtrees are
        unchanged), computed for the touched ones deepest first: the values :func:`processors.tables.item_metrics`
        gives the new tables."""
        # the touched states a depth at a time, deepest first (a state's children are settled before it: copied,
        # or one depth below), each depth with array passes over its states' edges
        depth = self.depth[built]
        for d in np.unique(depth)[::-1].tolist():
            states = self.new_id[built[depth == d]]
            lo = offsets[states]
            counts = offsets[states + 1] - lo  # (a touched state has edges)
            starts = np.zeros(states.size, dtype=np.int64)
            np.cumsum(counts[:-1], out=starts[1:])
            edges = np.repeat(lo - starts, counts) + np.arange(int(counts.sum()), dtype=np.int64)
            target = nxt[edges]
            inner = target >= 0
            at = np.maximum(target, 0)
            special = np.where(target == DONE, 0, 1)
            e_min = np.where(inner, min_rem[at], special).astype(np.int64)
            e_max = np.where(inner, max_rem[at], special).astype(np.int64)
            e_items = np.where(inner, items[at].astype(np.int64), 1)
            min_rem[states] = np.minimum(np.minimum.reduceat(e_min, starts) + 1, _UNSET)
            max_rem[states] = np.minimum(np.maximum.reduceat(e_max, starts) + 1, _UNSET)
            items[states] = np.minimum(np.add.reduceat(e_items, starts), _INT32_MAX)
        uniform = bool(np.array_equal(min_rem, max_rem))
        deepest = int(max_rem.max()) if self.n_new else 1
        min_rem = _freeze(min_rem)  # (uniform: the longest way down is the shortest, kept once, as item_metrics does)
        return (min_rem, _freeze(items), uniform, deepest), min_rem if uniform else _freeze(max_rem)
