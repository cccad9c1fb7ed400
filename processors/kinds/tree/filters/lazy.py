"""Filters resolved lazily over slot-ordered metadata (:mod:`processors.kinds.tree.filters.slots`): the cost of a
filter follows the states a request visits, not the catalog.

**A filter, lazily** (:class:`LazyFilter`). Nothing is computed when a filter is resolved but the blocks it may
pass (its clauses against the block summaries: a vector over ``n / BLOCK`` blocks). The question the decode step
asks, how many items that pass lie below a state (at most some ``cap``), is answered when asked, for those states:
the run's slots are read in chunks from the blocks that may pass (a gather and the clauses' comparisons per chunk,
all asked states at once) until ``cap`` passing items are found or the run ends, and the answer is kept per state.
A run with no passing item costs its candidate blocks; one with many costs about ``cap`` divided by the share that
passes. Once the scans have read 1/:data:`READ_SHARE` of the slots, the filter is evaluated over every slot once.

**What a request reads** (:class:`FilterView`): the item controls' book interface (:class:`processors.items.DenseBook`:
``lookup``, ``count``, ``ends_taken``, ``edges_ok``) with the request's own ``cap``: the most items its rows can take
or occupy, plus one. A state with at least ``cap`` passing items below it reads as having ``cap``: the rule "an item
is left for this row" (``item_count - used >= 1``) then holds exactly as with the whole count, since the other
books never hold ``cap`` items.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

from processors.tables import MaskTables, item_metrics

from processors.kinds.tree.filters.slots import SlotIndex

__all__ = ["FilterView", "LazyFilter"]

#: a filter's scans read at most 1/READ_SHARE of the slots (or 2^14) before the filter is evaluated over every slot
READ_SHARE = 32
#: slots per slice of that evaluation
SLICE = 1 << 20
#: slots read per state and round of a scan, at first (doubling each round)
FIRST_CHUNK = 16


def _untouched(n: int, dtype: Any) -> np.ndarray:
    """``n`` zeros of ``dtype`` in anonymous memory of small pages, none of them touched yet: a page is given (zeroed)
    when first written, so a sparse use costs the pages it writes. (``np.zeros`` of a large array asks for huge
    pages: a first write then zeroes 2 MiB.)"""
    size = max(int(n) * np.dtype(dtype).itemsize, 1)
    return np.frombuffer(mmap.mmap(-1, size), dtype=dtype, count=int(n))


class LazyFilter:
    """A filter resolved for one version, answered per state when asked (see the module docstring)."""

    def __init__(self, index: SlotIndex, tables: MaskTables, node: Any, budget: int | None = None):
        self.index, self.tables, self.node = index, tables, node
        may = index.may_pass(node)
        self._may = may
        self._may_blocks = np.flatnonzero(may)  # the blocks that may pass, in order
        self._rank = np.zeros(may.size + 1, dtype=np.int64)  # blocks that may pass before each block
        np.cumsum(may, out=self._rank[1:])
        # what was asked, per state and per edge, in arrays over the tables whose zeroed pages the OS gives on first
        # touch (:func:`_untouched`): their memory follows the states and edges asked, not the tables' size.
        # A state's entry: 0 not asked, else 1 + 2 * passing items found + (1 when its whole run was read);
        # an edge's: answered with the other edges of its state.
        self._state_memo = _untouched(tables.n_states, np.int32 if index.n < 2 ** 29 else np.int64)
        # the passing slots, sorted, once the runs read pass a share of the catalog without finding many (a
        # filter that passes few items, spread out): then one pass over the columns' slices gives every count
        self._passing: np.ndarray | None = None
        self._read = 0
        self._budget = max(index.n // READ_SHARE, 1 << 14) if budget is None else budget
        self._edge_memo = _untouched(tables.n_edges, np.int8)  # 0 not asked, 1 open, 2 closed

    def _candidate_position(self, slots: np.ndarray) -> np.ndarray:
        """Where each slot falls among the slots of the blocks that may pass (those slots numbered in order)."""
        size = self.index.block
        block = slots // size
        inside = np.zeros(slots.size, dtype=bool)
        real = block < self._may.size
        inside[real] = self._may[block[real]]
        return self._rank[block] * size + np.where(inside, slots - block * size, 0)

    def count_runs(self, lo: np.ndarray, hi: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray]:
        """``(count, complete)`` per run ``[lo, hi)`` of slots: the passing items found (at least ``cap`` when
        not complete), and whether the whole run was read (then ``count`` is exact). Only the slots of blocks
        that may pass are read, in chunks doubling each round, every open run at once."""
        if self._passing is not None:
            return self._counted(lo, hi), np.ones(lo.size, dtype=bool)
        pos = self._candidate_position(lo.astype(np.int64))
        end = self._candidate_position(hi.astype(np.int64))
        count = np.zeros(pos.size, dtype=np.int64)
        chunk = max(FIRST_CHUNK, 4 * cap)
        open_ = np.flatnonzero(pos < end)
        while open_.size:
            p = pos[open_]
            stop = np.minimum(p + chunk, end[open_])
            length = stop - p
            ends = np.cumsum(length)
            self._read += int(ends[-1])
            if self._read > self._budget:
                self._materialize()
                return self._counted(lo, hi), np.ones(lo.size, dtype=bool)
            j = np.arange(int(ends[-1]), dtype=np.int64) + np.repeat(p - (ends - length), length)
            size = self.index.block
            slots = self._may_blocks[j // size] * size + j % size
            ok = self.index.passes(self.node, slots)
            count[open_] += np.bincount(np.repeat(np.arange(open_.size), length)[ok], minlength=open_.size)
            pos[open_] = stop
            open_ = open_[(stop < end[open_]) & (count[open_] < cap)]
            chunk *= 2
        return count, pos >= end

    def _materialize(self) -> None:
        """The passing slots, by slices of the columns (no gather)."""
        parts = []
        for start in range(0, self.index.n, SLICE):
            stop = min(start + SLICE, self.index.n)
            parts.append(np.flatnonzero(self.index.passes(self.node, slice(start, stop))) + start)
        self._passing = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _counted(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        assert self._passing is not None
        return (np.searchsorted(self._passing, hi.astype(np.int64)) -
                np.searchsorted(self._passing, lo.astype(np.int64))).astype(np.int64)

    def state_counts(self, states: np.ndarray, cap: int) -> np.ndarray:
        """Passing items below each state (``-1``/``-2`` entries: 0), each at least ``min(cap, true count)`` and
        exact below ``cap``; kept per state."""
        states = np.asarray(states, dtype=np.int64)
        out = np.zeros(states.size, dtype=np.int64)
        real = np.flatnonzero(states >= 0)
        if not real.size:
            return out
        s = states[real]
        code = self._state_memo[s]
        count = (code - 1) >> 1
        usable = (code > 0) & (((code - 1) & 1).astype(bool) | (count >= cap))
        if not usable.all():
            todo = np.unique(s[~usable])
            lo = self.index.state_lo[todo].astype(np.int64)
            hi = lo + item_metrics(self.tables)[1][todo].astype(np.int64)
            c, done = self.count_runs(lo, hi, cap)
            self._state_memo[todo] = 1 + 2 * np.minimum(c, self.index.n) + done
            code = self._state_memo[s]
            count = (code - 1) >> 1
        out[real] = count
        return out

    def terminal_passes(self, terminals: np.ndarray) -> np.ndarray:
        """``bool`` per terminal id (an edge that ends an item, or ``n_edges + state``): its item passes. (An edge
        into a state reads as whether an item that passes lies below it.)"""
        terminals = np.asarray(terminals, dtype=np.int64)
        out = np.empty(terminals.size, dtype=bool)
        on_edge = terminals < self.tables.n_edges
        if on_edge.any():
            out[on_edge] = self.edges_ok(terminals[on_edge])
        if (~on_edge).any():
            out[~on_edge] = self.index.passes(self.node, self.index.terminal_slots(self.tables, terminals[~on_edge]))
        return out

    def edges_ok(self, edges: np.ndarray) -> np.ndarray:
        """``bool`` per edge: an item that passes lies below it (or it ends one). Answered for all the edges of each
        state the edges leave at once (what the vector lane and the beam step ask: the edges of the rows' states),
        kept per edge (one page of the array per state's edges)."""
        edges = np.asarray(edges, dtype=np.int64)
        memo = self._edge_memo[edges]
        todo = memo == 0
        if todo.any():
            offsets = self.tables.offsets
            src = np.searchsorted(offsets, edges[todo].astype(offsets.dtype), side="right") - 1
            self._answer_segments(np.unique(src))
            memo = self._edge_memo[edges]
        return memo == 1

    def _answer_segments(self, states: np.ndarray) -> None:
        """The answers of every edge of ``states``: for an edge into a state, whether a passing item lies below it
        (its run read until one is found); for an edge that ends an item, whether the item passes."""
        t = self.tables
        lo = t.offsets[states].astype(np.int64)
        counts = t.offsets[states + 1].astype(np.int64) - lo
        ends = np.cumsum(counts)
        edges = np.arange(int(ends[-1]) if ends.size else 0, dtype=np.int64) + np.repeat(lo - (ends - counts), counts)
        nxt = t.next_state[edges].astype(np.int64)
        inner = nxt >= 0
        ok = np.empty(edges.size, dtype=bool)
        if inner.any():
            target = nxt[inner]
            run_lo = self.index.state_lo[target].astype(np.int64)
            found, _ = self.count_runs(run_lo, run_lo + item_metrics(t)[1][target].astype(np.int64), 1)
            ok[inner] = found >= 1
        if (~inner).any():
            ok[~inner] = self.index.passes(self.node, self.index.edge_slots(t, edges[~inner]))
        self._edge_memo[edges] = np.where(ok, 1, 2)


class _Ends:
    """``terminal in ends``: the terminal's item does not pass (a :class:`FilterView`'s ``ends``)."""

    __slots__ = ("view",)

    def __init__(self, view: "FilterView"):
        self.view = view

    def __contains__(self, terminal: object) -> bool:
        if not isinstance(terminal, (int, np.integer)):
            return False
        return bool(self.view.ends_taken(np.asarray([int(terminal)], dtype=np.int64))[0])


class FilterView:
    """A :class:`LazyFilter` read as a book of the items it leaves out, with a request's ``cap`` (see the module
    docstring): what :class:`~processors.items.ItemRequest.base` holds."""

    __slots__ = ("lazy", "cap", "ends")

    def __init__(self, lazy: LazyFilter, cap: int):
        self.lazy, self.cap = lazy, max(int(cap), 1)
        self.ends = _Ends(self)

    def __bool__(self) -> bool:
        return True

    def lookup(self, states: np.ndarray) -> np.ndarray:
        """Items left out below each state as the rows see them (``item_count`` minus the passing ones, at most
        ``cap`` of those); 0 for ``LEAF`` / ``DONE``."""
        states = np.asarray(states, dtype=np.int64)
        out = np.zeros(states.shape, dtype=np.int64)
        real = states >= 0
        if real.any():
            s = states[real]
            passing = np.minimum(self.lazy.state_counts(s, self.cap), self.cap)
            out[real] = item_metrics(self.lazy.tables)[1][s].astype(np.int64) - passing
        return out

    def count(self, state: int) -> int:
        return int(self.lookup(np.asarray([state], dtype=np.int64))[0]) if state >= 0 else 0

    def ends_taken(self, terminals: np.ndarray) -> np.ndarray:
        terminals = np.asarray(terminals, dtype=np.int64)
        return ~self.lazy.terminal_passes(terminals)

    def edges_ok(self, tables: MaskTables, edges: np.ndarray) -> np.ndarray:
        """``bool`` per edge of ``tables`` (the ones the filter was resolved on): a row may take it."""
        return self.lazy.edges_ok(edges)

    def passing(self, cap: int | None = None) -> int:
        """Items that pass below the root, at most ``cap`` (default: this view's)."""
        root = self.lazy.tables.root
        if root < 0:
            return 0
        c = self.cap if cap is None else max(int(cap), 1)
        return int(min(self.lazy.state_counts(np.asarray([root]), c)[0], c))

