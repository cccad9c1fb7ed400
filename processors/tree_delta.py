"""A catalog's tables after a delta, updated along the changed paths only (``PATCH /admin/scenarios/{name}``).

:func:`patch_tables` takes the tables of a catalog as :func:`~processors.catalog_tables.catalog_tables` builds them
(the trie's nodes with a continuation are the states, numbered in preorder: a prefix before its extensions,
siblings by token) and the items added and removed, and gives the tables :func:`catalog_tables` would build from
the new item set: **byte for byte the same arrays** (``offsets``, ``tokens``, ``next_state``, ``keys``, ``root``,
so the same ``version``) and the same item metrics (``min_remaining``, ``item_count``, ``uniform``, ``deepest``).
``tests/unit/test_tree_delta.py`` checks this against a full compile over random catalogs and sequences of deltas.

The work follows the delta, not the catalog:

* the *touched* paths are the prefixes of the added and removed items; only they can change. Each is looked up in
  the old tables (one ``searchsorted`` per id), and its new children and end flag are settled deepest first (a
  node without an item below it any more is dropped, an old leaf that gains an extension becomes a state);
* a new state's place is its preorder rank among the old states (the first old state after its path), so the
  old states keep their order and the new ones go in between: a state's new number is its old one, less the
  removed states before it, plus the new states before it (array passes over the states, no sort);
* the edges of untouched states are copied with their targets renumbered; the touched states' edges are written
  from their new children; the item metrics of untouched states are copied (their subtrees did not change) and
  those of touched states recomputed, deepest first.

Every array is still copied once (the tables are immutable and shared with the replicas): copies and gathers over
all states and edges, a few milliseconds per million, against the sorts of a full compile.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from config.cancel import checkpoint

from .tables import _UNSET, DONE, LEAF, MaskTables, _freeze, item_metrics

__all__ = ["patch_tables", "max_remaining"]

_INT32_MAX = np.iinfo(np.int32).max


def max_remaining(tables: MaskTables) -> np.ndarray:
    """The longest way to an end per state (end token included): kept by :func:`item_metrics` where the tables
    were built (it does not travel with pickled tables); computed again when missing."""
    cached = tables.__dict__.get("_max_remaining")
    if cached is None:
        from .tables import _item_metrics

        _item_metrics(tables)  # stores it
        cached = tables.__dict__.get("_max_remaining")
        if cached is None:  # no states
            cached = np.zeros(0, dtype=np.int32)
    return cached


class _Old:
    """Lookups in the old tables (Python ints out)."""

    def __init__(self, tables: MaskTables):
        self.t = tables
        self.offsets, self.tokens, self.nxt, self.keys = tables.offsets, tables.tokens, tables.next_state, tables.keys
        self.base = tables.key_base

    def target(self, state: int, token: int) -> int | None:
        """The target of ``state --token-->`` (a state, ``LEAF`` or ``DONE``), ``None`` without that edge."""
        key = state * self.base + token
        i = int(self.keys.searchsorted(key))
        if i < self.keys.size and int(self.keys[i]) == key:
            return int(self.nxt[i])
        return None

    def first_state_after(self, state: int, token: int, stack: list[tuple[int, int]]) -> int:
        """The first state (in preorder) after every path ``state`` + ``(t, ...)`` with ``t <= token``: the first
        child state of ``state`` by a larger token, else the first state after ``state``'s subtree."""
        while True:
            lo, hi = int(self.offsets[state]), int(self.offsets[state + 1])
            at = lo + int(self.tokens[lo:hi].searchsorted(token, side="right"))
            later = np.flatnonzero(self.nxt[at:hi] >= 0)
            if later.size:
                return int(self.nxt[at + int(later[0])])
            if not stack:
                return self.t.n_states
            state, token = stack.pop()

    def rank(self, path: tuple[int, ...]) -> int:
        """How many old states come before ``path`` (not an old state) in preorder."""
        stack: list[tuple[int, int]] = []
        state = self.t.root
        for token in path:
            target = self.target(state, token)
            if target is None or target < 0:
                return self.first_state_after(state, token, stack)
            stack.append((state, token))
            state = target
        raise AssertionError("rank of an old state")


def patch_tables(tables: MaskTables, add: Iterable[Sequence[int]], remove: Iterable[Sequence[int]]) -> MaskTables | None:
    """The tables of the catalog ``tables`` was built from, with ``add`` added and ``remove`` removed (an add
    already present and a remove not present are no-ops), equal to :func:`~processors.catalog_tables.catalog_tables`
    of the new items (see the module). ``tables`` must be a catalog's tables in that form (states in preorder).
    ``None`` where the old tables cannot tell their items (no state: an empty catalog and the catalog of the empty
    item give the same tables): the caller compiles the new items in full."""
    end = tables.end_token_id
    if tables.root < 0:
        return None
    old = _Old(tables)
    adds = {tuple(int(t) for t in item) for item in add}
    removes = {tuple(int(t) for t in item) for item in remove}
    # the paths of every add and remove and, for each, its old node: a state, LEAF (an old leaf) or ABSENT
    node: dict[tuple[int, ...], int] = {(): tables.root}
    kids: dict[tuple[int, ...], set[int]] = {}
    for item in adds | removes:
        state = tables.root
        for d in range(len(item)):
            path = item[: d + 1]
            kids.setdefault(item[:d], set()).add(item[d])
            if path in node:
                state = node[path]
                continue
            target = old.target(state, item[d]) if state >= 0 else None
            state = ABSENT if target is None or target == DONE else target
            node[path] = state
    was_end: dict[tuple[int, ...], bool] = {}  # the old item set has the path
    for path, state in node.items():
        was_end[path] = state == LEAF or (state >= 0 and old.target(state, end) == DONE)
    adds = {p for p in adds if not was_end[p]}  # (no-ops: an add already there, a remove not there)
    removes = {p for p in removes if was_end[p]}
    if not adds and not removes:
        return tables
    checkpoint()
    # settle the touched paths deepest first: end flag, number of children, is it still there
    order = sorted(node, key=len, reverse=True)
    alive: dict[tuple[int, ...], bool] = {}
    new_end: dict[tuple[int, ...], bool] = {}
    is_state: dict[tuple[int, ...], bool] = {}
    for path in order:
        state = node[path]
        ended = was_end[path]
        n_children = int(tables.offsets[state + 1] - tables.offsets[state]) - ended if state >= 0 else 0
        for t in kids.get(path, ()):
            child = path + (t,)
            if alive[child] and node[child] == ABSENT:
                n_children += 1
            elif not alive[child] and node[child] != ABSENT:
                n_children -= 1
        is_end = (ended or path in adds) and path not in removes
        new_end[path], is_state[path] = is_end, n_children > 0
        alive[path] = n_children > 0 or is_end or not path
    removed = np.array(sorted(node[p] for p in order if node[p] >= 0 and not is_state[p]), dtype=np.int64)
    modified = [p for p in order if is_state[p] and node[p] >= 0]
    rank: dict[tuple[int, ...], int] = {}  # a new state's old-state count before it: its parent's, if new too
    for p in sorted((p for p in order if is_state[p] and node[p] < 0), key=len):
        rank[p] = rank[p[:-1]] if p[:-1] in rank else old.rank(p)
    fresh = sorted((r, p) for p, r in rank.items())
    checkpoint()
    plan = _Plan(tables, node, kids, alive, is_state, was_end, new_end, removed, modified, fresh)
    return plan.assemble()


ABSENT = -3  # a touched path that is not a node of the old trie

_WIDE = 32  # a state with more edges than this is edited with array operations, a narrower one as Python lists


class _Plan:
    """The new tables from the settled touched paths (see the module)."""

    def __init__(self, tables, node, kids, alive, is_state, was_end, new_end, removed, modified, fresh):
        self.t, self.node, self.kids, self.alive, self.is_state = tables, node, kids, alive, is_state
        self.was_end, self.new_end, self.removed, self.modified = was_end, new_end, removed, modified
        n_old = tables.n_states
        ranks = np.array([r for r, _ in fresh], dtype=np.int64)
        keep = np.ones(n_old, dtype=bool)
        keep[removed] = False
        removed_before = np.zeros(n_old + 1, dtype=np.int64)
        np.cumsum(~keep, out=removed_before[1:])
        old_ids = np.arange(n_old, dtype=np.int64)
        self.new_of_old = old_ids - removed_before[:-1] + ranks.searchsorted(old_ids, side="right")
        self.ranks = ranks
        new_of_fresh = ranks - removed_before[ranks] + np.arange(ranks.size, dtype=np.int64)
        self.n_new = n_old - removed.size + ranks.size
        self.new_id = {p: int(new_of_fresh[j]) for j, (_, p) in enumerate(fresh)}
        for p in modified:
            self.new_id[p] = int(self.new_of_old[node[p]])
        self.keep = keep

    def _child_target(self, child: tuple[int, ...]) -> int:
        return self.new_id[child] if self.is_state[child] else LEAF

    def edges(self, p: tuple[int, ...]):
        """The new edges of touched state ``p``: ``(tokens, targets)`` (lists, or arrays for a wide old state)."""
        end, state = self.t.end_token_id, self.node[p]
        if state < 0:  # a new state: every child is touched
            pairs = [(t, self._child_target(p + (t,))) for t in self.kids[p] if self.alive[p + (t,)]]
            if self.new_end[p]:
                pairs.append((end, DONE))
            pairs.sort()
            return [t for t, _ in pairs], [x for _, x in pairs]
        lo, hi = int(self.t.offsets[state]), int(self.t.offsets[state + 1])
        wide = hi - lo > _WIDE
        toks = self.t.tokens[lo:hi]
        tgts = self.t.next_state[lo:hi].astype(np.int64)
        inner = tgts >= 0
        tgts[inner] = self.new_of_old[tgts[inner]]
        if not wide:
            toks, tgts = toks.tolist(), tgts.tolist()
        drop, extra = [], []
        for t in self.kids.get(p, ()):
            child = p + (t,)
            if self.node[child] == ABSENT:
                if self.alive[child]:
                    extra.append((t, self._child_target(child)))
                continue
            at = int(np.searchsorted(toks, t)) if wide else toks.index(t)
            if self.alive[child]:
                tgts[at] = self._child_target(child)
            else:
                drop.append(at)
        if self.was_end[p] and not self.new_end[p]:
            drop.append(int(np.searchsorted(toks, end)) if wide else toks.index(end))
        if self.new_end[p] and not self.was_end[p]:
            extra.append((end, DONE))
        if wide:
            if drop:
                toks, tgts = np.delete(toks, drop), np.delete(tgts, drop)
            if extra:
                toks = np.concatenate((toks, [t for t, _ in extra]))
                tgts = np.concatenate((tgts, [x for _, x in extra]))
                order = np.argsort(toks, kind="stable")
                toks, tgts = toks[order], tgts[order]
            return toks, tgts
        for at in sorted(drop, reverse=True):
            del toks[at], tgts[at]
        if extra:
            pairs = sorted([*zip(toks, tgts), *extra])
            toks, tgts = [t for t, _ in pairs], [x for _, x in pairs]
        return toks, tgts

    def runs(self) -> list[tuple[int, int, int]]:
        """The untouched old states as runs ``(a, b, new number of a)``: old states ``a..b-1`` keep their edges
        and become ``a'..a'+b-a-1`` (no removed, touched or new state falls inside a run)."""
        cut = np.concatenate(([0, self.t.n_states], self.removed, self.removed + 1, self.mod_ids, self.mod_ids + 1,
                              self.ranks))
        cut = np.unique(cut[cut <= self.t.n_states]).tolist()
        copy = self.copy
        return [(a, b, int(self.new_of_old[a])) for a, b in zip(cut[:-1], cut[1:]) if copy[a]]

    def assemble(self) -> MaskTables:
        t, n_new = self.t, self.n_new
        self.mod_ids = np.array([self.node[p] for p in self.modified], dtype=np.int64)
        self.copy = self.keep.copy()
        self.copy[self.mod_ids] = False
        built = sorted(self.new_id, key=self.new_id.__getitem__)
        built_edges = [self.edges(p) for p in built]
        runs = self.runs()
        checkpoint()
        # the new offsets: the runs' edge counts as they were, the touched states' from their new edges
        old_off = t.offsets
        counts = np.zeros(n_new, dtype=np.int64)
        old_counts = np.diff(old_off)
        for a, b, na in runs:
            counts[na:na + b - a] = old_counts[a:b]
        del old_counts
        built_ids = [self.new_id[p] for p in built]
        counts[built_ids] = [len(toks) for toks, _ in built_edges]
        offsets = np.zeros(n_new + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        del counts
        n_edges = int(offsets[-1])
        tokens = np.empty(n_edges, dtype=np.int32)
        nxt = np.empty(n_edges, dtype=np.int32)
        keys = np.empty(n_edges, dtype=np.int64)
        # every old target renumbered at once (a lookup table with LEAF and DONE in front), then copied by runs
        lut = np.empty(t.n_states + 2, dtype=np.int32)
        lut[0], lut[1] = DONE, LEAF
        lut[2:] = self.new_of_old
        moved = lut.take(t.next_state + np.int32(2))
        del lut
        base = np.int64(t.key_base)
        for a, b, na in runs:
            e0, e1 = int(old_off[a]), int(old_off[b])
            d0 = int(offsets[na])
            d1 = d0 + e1 - e0
            tokens[d0:d1] = t.tokens[e0:e1]
            nxt[d0:d1] = moved[e0:e1]
            np.add(t.keys[e0:e1], (na - a) * base, out=keys[d0:d1])
        del moved
        for s, (toks, tgts) in zip(built_ids, built_edges):
            lo, hi = int(offsets[s]), int(offsets[s + 1])
            tokens[lo:hi] = toks
            nxt[lo:hi] = tgts
            keys[lo:hi] = np.asarray(toks, dtype=np.int64) + s * base
        checkpoint()
        root = self.new_id[()] if self.is_state[()] else LEAF
        metrics, max_rem = self.metrics(runs, offsets, nxt, built)
        return MaskTables.assemble(offsets, tokens, nxt, keys, root, t.end_token_id, t.vocab_size, metrics, max_rem)

    def metrics(self, runs, offsets, nxt, built):
        """The item metrics of the new tables: copied for untouched states (their subtrees are unchanged), computed
        for touched ones deepest first: the values :func:`processors.tables.item_metrics` gives the new tables."""
        old_min, old_items, _, _ = item_metrics(self.t)
        old_max = max_remaining(self.t)
        min_rem = np.empty(self.n_new, dtype=np.int32)
        max_rem = np.empty(self.n_new, dtype=np.int32)
        items = np.empty(self.n_new, dtype=np.int32)
        for a, b, na in runs:
            min_rem[na:na + b - a] = old_min[a:b]
            max_rem[na:na + b - a] = old_max[a:b]
            items[na:na + b - a] = old_items[a:b]
        for p in sorted(built, key=len, reverse=True):
            s = self.new_id[p]
            lo, hi = int(offsets[s]), int(offsets[s + 1])
            target = nxt[lo:hi]
            if hi - lo > _WIDE:
                inner = target >= 0
                at = np.maximum(target, 0)
                special = np.where(target == DONE, 0, 1)
                lo_v = int(np.where(inner, min_rem[at], special).min())
                hi_v = int(np.where(inner, max_rem[at], special).max())
                count = int(np.where(inner, items[at].astype(np.int64), 1).sum())
            else:
                lo_v, hi_v, count = _UNSET, 0, 0
                for x in target.tolist():
                    if x >= 0:
                        lo_v, hi_v = min(lo_v, int(min_rem[x])), max(hi_v, int(max_rem[x]))
                        count += int(items[x])
                    else:
                        v = 0 if x == DONE else 1
                        lo_v, hi_v, count = min(lo_v, v), max(hi_v, v), count + 1
            min_rem[s], max_rem[s] = min(lo_v + 1, _UNSET), min(hi_v + 1, _UNSET)
            items[s] = min(count, _INT32_MAX)
        uniform = bool(np.array_equal(min_rem, max_rem))
        deepest = int(max_rem.max()) if self.n_new else 1
        return (_freeze(min_rem), _freeze(items), uniform, deepest), _freeze(max_rem)
