"""Item metadata in tree order: what a filter is evaluated on (:mod:`processors.kinds.tree.filters.lazy` resolves
filters over it, in the cost of the states a request visits).

**Slots.** The items below one state of the tables are one contiguous run in a depth-first walk that takes each
state's edges in their order. An item's *slot* is its place in that walk; state ``s``'s items are the slots
``[state_lo[s], state_lo[s] + item_count[s])``, an edge into state ``c`` covers ``c``'s run and an edge that ends an
item covers its one slot. :class:`SlotIndex` holds ``state_lo`` and the metadata columns permuted into slot order,
plus per block of :data:`BLOCK` slots a summary of each column (numbers: min and max; categories: which values
occur), built once per version where the tables are compiled; a metadata PATCH's updates are held beside its arrays
(:class:`Overrides`). :meth:`SlotIndex.passes` evaluates a filter at slots, :meth:`SlotIndex.may_pass` per block.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from config import ConstraintError
from processors.tables import MaskTables, item_metrics

from processors.kinds.tree.filters.metadata import CATEGORICAL, NUMERIC, Column, ItemMetadata

__all__ = ["BLOCK", "Overrides", "SlotColumn", "SlotIndex", "tree_slots"]

#: slots per block of the block summaries
BLOCK = 1024
#: a categorical column of at most this many values is kept as one bit per value (a list column: per slot too)
BITS = 64


class SlotColumn:
    """One metadata field over the slots (see the module docstring): ``numbers`` (float64, NaN missing), ``codes``
    (int32, -1 missing) of a one-value categorical field, or a list field as ``bits`` (uint64 per slot, bit ``c``:
    the slot holds value ``c``; at most :data:`BITS` values) or ``offsets`` + ``codes`` (the values of slot ``i``
    are ``codes[offsets[i]:offsets[i + 1]]``). Block summaries: ``bmin`` / ``bmax`` (numbers), ``bbits`` (bits per
    block) or ``bkeys`` (the sorted distinct ``block * (values + 1) + code + 1`` of the block's entries)."""

    __slots__ = ("name", "kind", "values", "numbers", "codes", "bits", "offsets", "bmin", "bmax", "bbits", "bkeys",
                 "_index")

    def __init__(self, name: str, kind: str, values: tuple = (), **arrays: Any):
        self.name, self.kind, self.values = name, kind, values
        # (numpy arrays or None, as the module docstring says which)
        self.numbers: Any = arrays.get("numbers")
        self.codes: Any = arrays.get("codes")
        self.bits: Any = arrays.get("bits")
        self.offsets: Any = arrays.get("offsets")
        self.bmin: Any = arrays.get("bmin")
        self.bmax: Any = arrays.get("bmax")
        self.bbits: Any = arrays.get("bbits")
        self.bkeys: Any = arrays.get("bkeys")
        self._index: dict[Any, int] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__ if k != "_index"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        self._index = None

    def schema(self) -> Column:
        """The field as a filter is checked against it (its kind and values; no arrays)."""
        return Column(self.name, self.kind, self.values)


def _blocks(n: int, block: int) -> int:
    return (n + block - 1) // block


def _block_starts(n: int, block: int) -> np.ndarray:
    return np.arange(0, n, block, dtype=np.int64)


def _slot_column(col: Column, row_of_slot: np.ndarray, n: int, block_size: int) -> SlotColumn:
    """``col`` (over the catalog's rows) permuted into slot order; ``row_of_slot[i] == -1``: no row (missing)."""
    starts = _block_starts(n, block_size)
    if col.kind == NUMERIC:
        assert col.numbers is not None
        ext = np.append(col.numbers, np.nan)  # index -1: missing
        numbers = ext[row_of_slot]
        with np.errstate(all="ignore"):
            bmin = np.fmin.reduceat(numbers, starts) if n else np.zeros(0)
            bmax = np.fmax.reduceat(numbers, starts) if n else np.zeros(0)
        return SlotColumn(col.name, NUMERIC, numbers=numbers, bmin=bmin, bmax=bmax)
    assert col.codes is not None
    v = len(col.values)
    if not col.is_list:
        codes = np.append(col.codes, np.int32(-1))[row_of_slot].astype(np.int32)
        if v <= BITS:
            bits = np.where(codes >= 0, np.left_shift(np.uint64(1), np.maximum(codes, 0).astype(np.uint64)),
                            np.uint64(0)).astype(np.uint64)
            bbits = np.bitwise_or.reduceat(bits, starts) if n else np.zeros(0, np.uint64)
            return SlotColumn(col.name, CATEGORICAL, col.values, codes=codes, bbits=bbits)
        block = np.arange(n, dtype=np.int64) // block_size
        bkeys = np.unique(block * (v + 1) + codes.astype(np.int64) + 1)
        return SlotColumn(col.name, CATEGORICAL, col.values, codes=codes, bkeys=bkeys)
    assert col.offsets is not None
    lengths = np.append(np.diff(col.offsets), 0)[row_of_slot]  # (index -1: no row, no values)
    src = np.append(col.offsets[:-1], 0)[row_of_slot]
    total = int(lengths.sum())
    ends = np.cumsum(lengths)
    entry = np.arange(total, dtype=np.int64) + np.repeat(src - (ends - lengths), lengths)
    codes = col.codes[entry].astype(np.int32)
    slot_of_entry = np.repeat(np.arange(n, dtype=np.int64), lengths)
    if v <= BITS:
        bits = np.zeros(n, dtype=np.uint64)
        np.bitwise_or.at(bits, slot_of_entry, np.left_shift(np.uint64(1), codes.astype(np.uint64)))
        bbits = np.bitwise_or.reduceat(bits, starts) if n else np.zeros(0, np.uint64)
        return SlotColumn(col.name, CATEGORICAL, col.values, bits=bits, bbits=bbits)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    bkeys = np.unique((slot_of_entry // block_size) * (v + 1) + codes.astype(np.int64) + 1)
    missing = np.flatnonzero(lengths == 0)  # a slot without values: the "missing" code 0 of its block
    bkeys = np.union1d(bkeys, np.unique((missing // block_size) * (v + 1)))
    return SlotColumn(col.name, CATEGORICAL, col.values, codes=codes, offsets=offsets, bkeys=bkeys)


def tree_slots(tables: MaskTables) -> tuple[np.ndarray, np.ndarray]:
    """``(state_lo, edge_lo)``: the first slot of each state's and each edge's items in the depth-first walk (-1
    for states and edges the root does not reach). One pass over the tables' levels from the root (a state has one
    edge into it in the tables of a catalog: each level's targets are the next level's states as they come)."""
    item_count = item_metrics(tables)[1].astype(np.int64)
    nxt = tables.next_state.astype(np.int64)
    offsets = tables.offsets.astype(np.int64)
    weight = np.where(nxt >= 0, item_count[np.maximum(nxt, 0)], 1)
    state_lo = np.full(tables.n_states, -1, dtype=np.int64)
    edge_lo = np.full(tables.n_edges, -1, dtype=np.int64)
    if tables.root < 0:
        return state_lo, edge_lo
    state_lo[tables.root] = 0
    states = np.array([tables.root], dtype=np.int64)
    seen = 0
    while states.size:
        seen += states.size
        if seen > tables.n_states:
            raise ValueError("a state is reached by more than one edge: not the tables of a catalog")
        counts = offsets[states + 1] - offsets[states]
        total = int(counts.sum())
        if not total:
            break
        ends = np.cumsum(counts)
        edges = np.arange(total, dtype=np.int64) + np.repeat(offsets[states] - (ends - counts), counts)
        w = weight[edges]
        before = np.cumsum(w) - w  # the weights of the level's edges before each
        lo = np.repeat(state_lo[states] - before[ends - counts], counts) + before
        edge_lo[edges] = lo
        target = nxt[edges]
        inner = target >= 0
        states = target[inner]
        state_lo[states] = lo[inner]
    return state_lo, edge_lo


class SlotIndex:
    """A catalog version's metadata in slot order and its block summaries (see the module docstring)."""

    def __init__(self, n: int, state_lo: np.ndarray, columns: dict[str, SlotColumn], block: int = BLOCK,
                 overrides: "Overrides | None" = None):
        self.n, self.block = n, block
        self.state_lo = state_lo
        self.columns = columns
        self.overrides = overrides
        fields = {name: col.schema() for name, col in columns.items()}
        if overrides is not None:
            for name, col in overrides.columns.items():
                fields.setdefault(name, col.schema())
        self.schema = ItemMetadata(n, fields)

    def __getstate__(self) -> dict[str, Any]:
        return {"n": self.n, "state_lo": self.state_lo, "columns": self.columns, "block": self.block,
                "overrides": self.overrides}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["n"], state["state_lo"], state["columns"], state["block"],  # type: ignore[misc]
                      state.get("overrides"))

    def updated(self, slots: np.ndarray, metadata: ItemMetadata) -> "SlotIndex":
        """This index with the items at ``slots`` given the metadata ``metadata`` (one row per entry, in that order;
        a row replaces the item's metadata whole): the same arrays, and the updates kept beside them
        (:class:`Overrides`, merged with the earlier ones: the newest wins). Its cost follows the updated items.
        A field of another kind than the index's is a 422 naming it."""
        for name, col in metadata.columns.items():
            have = self.schema.columns.get(name)
            if have is not None and have.kind != col.kind:
                raise ConstraintError(422, f"metadata: field {name!r} is {col.kind} in an update and {have.kind} in "
                                           "the catalog", {"field": "update", "name": name})
        slots = np.asarray(slots, dtype=np.int64)
        old = self.overrides
        if old is not None and old.slots.size:
            keep = ~np.isin(old.rows_slots, slots)
            merged = old.metadata.spliced(keep, metadata)
            row_slots = np.concatenate((old.rows_slots[keep], slots))
        else:
            merged, row_slots = metadata, slots
        return SlotIndex(self.n, self.state_lo, self.columns, self.block, Overrides(merged, row_slots))

    def edge_slots(self, tables: MaskTables, edges: np.ndarray) -> np.ndarray:
        """The first slot of each edge's items: its state's first slot plus the items of the edges before it (one
        pass over each distinct state's edges)."""
        edges = np.asarray(edges, dtype=np.int64)
        # (the edges in the offsets' dtype: else numpy converts the whole offsets array at each call)
        src = np.searchsorted(tables.offsets, edges.astype(tables.offsets.dtype), side="right") - 1
        item_count = item_metrics(tables)[1]
        out = np.empty(edges.size, dtype=np.int64)
        for s in np.unique(src).tolist():
            a, b = int(tables.offsets[s]), int(tables.offsets[s + 1])
            nxt = tables.next_state[a:b].astype(np.int64)
            w = np.where(nxt >= 0, item_count[np.maximum(nxt, 0)], 1).astype(np.int64)
            lo = int(self.state_lo[s]) + np.cumsum(w) - w
            sel = src == s
            out[sel] = lo[edges[sel] - a]
        return out

    def terminal_slots(self, tables: MaskTables, terminals: np.ndarray) -> np.ndarray:
        """The slot of each terminal id's item (an edge that ends it, or ``n_edges + state``; -1 stays -1)."""
        terminals = np.asarray(terminals, dtype=np.int64)
        out = np.full(terminals.size, -1, dtype=np.int64)
        on_state = terminals >= tables.n_edges
        out[on_state] = self.state_lo[terminals[on_state] - tables.n_edges]
        on_edge = (terminals >= 0) & ~on_state
        if on_edge.any():
            out[on_edge] = self.edge_slots(tables, terminals[on_edge])
        return out

    @property
    def overridden(self) -> int:
        """Items whose metadata the overrides hold."""
        return 0 if self.overrides is None else int(self.overrides.slots.size)

    @classmethod
    def build(cls, tables: MaskTables, metadata: ItemMetadata, terminals: np.ndarray, block: int = BLOCK
              ) -> "SlotIndex":
        """The index of the items whose metadata is ``metadata`` (catalog rows) and whose terminals in ``tables``
        are ``terminals`` (:func:`~processors.kinds.tree.filters.edges.item_terminals`; -1: not in the tables)."""
        state_lo, edge_lo = tree_slots(tables)
        n = int(item_metrics(tables)[1][tables.root]) if tables.root >= 0 else 0
        term = terminals.astype(np.int64)
        valid = term >= 0
        slot = np.full(term.size, -1, dtype=np.int64)
        on_edge = valid & (term < tables.n_edges)
        slot[on_edge] = edge_lo[term[on_edge]]
        on_state = valid & ~on_edge
        slot[on_state] = state_lo[term[on_state] - tables.n_edges]
        row_of_slot = np.full(n, -1, dtype=np.int64)
        rows = np.flatnonzero(slot >= 0)
        row_of_slot[slot[rows]] = rows
        columns = {name: _slot_column(col, row_of_slot, n, block) for name, col in metadata.columns.items()}
        narrow = state_lo.astype(np.int32) if n < 2 ** 31 else state_lo
        narrow.setflags(write=False)
        return cls(n, narrow, columns, block)

    def passes(self, node: Any, slots: "np.ndarray | slice") -> np.ndarray:
        """``bool`` per entry of ``slots`` (or per slot of a slice): the filter ``node`` (a
        :class:`~processors.kinds.tree.filters.language.Filter`) passes that slot's item."""
        out = _eval(node, self.columns, slots)
        over = self.overrides
        if over is None or not over.slots.size:
            return out
        if isinstance(slots, slice):
            a, b = np.searchsorted(over.slots, [slots.start, slots.stop])
            if b > a:
                out[over.slots[a:b] - slots.start] = _eval(node, over.columns, np.arange(a, b, dtype=np.int64))
            return out
        at = np.minimum(np.searchsorted(over.slots, slots), over.slots.size - 1)
        hit = over.slots[at] == slots
        if hit.any():
            out[hit] = _eval(node, over.columns, at[hit])
        return out

    def may_pass(self, node: Any) -> np.ndarray:
        """``bool`` per block: some slot of the block may pass ``node`` (False: none does)."""
        may = _may(node, self.columns, _blocks(self.n, self.block))
        if self.overrides is not None and self.overrides.slots.size:
            may[np.unique(self.overrides.slots // self.block)] = True  # (an updated item: read it)
        return may


class Overrides:
    """Items whose metadata was updated after an index was built: their slots, sorted, and their metadata as
    columns in that order (``columns``, :class:`SlotColumn` without block summaries); ``metadata`` and
    ``rows_slots`` are the same rows in the order they were merged (what the next update merges with)."""

    def __init__(self, metadata: ItemMetadata, rows_slots: np.ndarray):
        self.metadata, self.rows_slots = metadata, rows_slots
        order = np.argsort(rows_slots, kind="stable")
        self.slots = rows_slots[order]
        self.columns = {name: _slot_column(col, order, int(order.size), max(int(order.size), 1))
                        for name, col in metadata.columns.items()}

    def __getstate__(self) -> dict[str, Any]:
        return {"metadata": self.metadata, "rows_slots": self.rows_slots}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["metadata"], state["rows_slots"])  # type: ignore[misc]


def _wanted(col: SlotColumn, op: str, value: Any) -> list[int]:
    if col._index is None:
        col._index = {(0, v) if isinstance(v, bool) else (1, v): i for i, v in enumerate(col.values)}
    keys = [((0, v) if isinstance(v, bool) else (1, v)) for v in (value if op in ("$in", "$nin") else (value,))]
    return [c for c in (col._index.get(k, -1) for k in keys) if c >= 0]


def _mask_bits(codes: list[int]) -> np.uint64:
    out = 0
    for c in codes:
        out |= 1 << c
    return np.uint64(out)


def _eval(node: Any, columns: dict[str, SlotColumn], slots: "np.ndarray | slice") -> np.ndarray:
    from processors.kinds.tree.filters.language import Filter

    if isinstance(node, Filter):
        out: np.ndarray | None = None
        for part in node.parts:
            m = _eval(part, columns, slots)
            out = m if out is None else (out & m if node.op == "and" else out | m)
        return out if out is not None else np.ones(_size(slots), dtype=bool)
    col, op, value = columns.get(node.column.name), node.op, node.value
    if col is None:  # no item here has the field: missing passes the negations only
        return np.full(_size(slots), op in ("$ne", "$nin"), dtype=bool)
    if col.kind == NUMERIC:
        x = col.numbers[slots]
        if op == "$eq":
            return x == value
        if op == "$ne":
            return ~(x == value)
        if op in ("$in", "$nin"):
            hit = np.isin(x, np.asarray(value, dtype=np.float64))
            return hit if op == "$in" else ~hit
        return {"$gt": np.greater, "$gte": np.greater_equal, "$lt": np.less, "$lte": np.less_equal}[op](x, value)
    wanted = _wanted(col, op, value)
    if col.bits is not None:
        hit = (col.bits[slots] & _mask_bits(wanted)) != 0
    elif col.offsets is None:
        c = col.codes[slots]
        hit = c == wanted[0] if len(wanted) == 1 else np.isin(c, wanted)
    else:
        if isinstance(slots, slice):
            slots = np.arange(slots.start, slots.stop, dtype=np.int64)
        lo, hi = col.offsets[slots], col.offsets[slots + 1]
        lengths = hi - lo
        ends = np.cumsum(lengths)
        entries = np.arange(int(ends[-1]) if ends.size else 0, dtype=np.int64) + np.repeat(lo - (ends - lengths),
                                                                                           lengths)
        found = np.isin(col.codes[entries], wanted)
        hit = np.zeros(slots.size, dtype=bool)
        hit[np.repeat(np.arange(slots.size), lengths)[found]] = True
    return hit if op in ("$eq", "$in") else ~hit


def _size(slots: "np.ndarray | slice") -> int:
    return slots.stop - slots.start if isinstance(slots, slice) else int(slots.size)


def _may(node: Any, columns: dict[str, SlotColumn], blocks: int) -> np.ndarray:
    from processors.kinds.tree.filters.language import Filter

    if isinstance(node, Filter):
        out: np.ndarray | None = None
        for part in node.parts:
            m = _may(part, columns, blocks)
            out = m if out is None else (out & m if node.op == "and" else out | m)
        return out if out is not None else np.ones(blocks, dtype=bool)
    col, op, value = columns.get(node.column.name), node.op, node.value
    if col is None:
        return np.full(blocks, op in ("$ne", "$nin"), dtype=bool)
    if op in ("$ne", "$nin"):
        return np.ones(blocks, dtype=bool)  # (a block holds other values or missing ones: not summarized)
    if col.kind == NUMERIC:
        lo, hi = col.bmin, col.bmax
        with np.errstate(invalid="ignore"):
            if op == "$eq":
                return (lo <= value) & (value <= hi)
            if op == "$in":
                vs = np.asarray(value, dtype=np.float64)
                out = np.zeros(blocks, dtype=bool)
                for v in vs.tolist():
                    out |= (lo <= v) & (v <= hi)
                return out
            return {"$gt": hi > value, "$gte": hi >= value, "$lt": lo < value, "$lte": lo <= value}[op]
    wanted = _wanted(col, op, value)
    if not wanted:
        return np.zeros(blocks, dtype=bool)
    if col.bbits is not None:
        return (col.bbits & _mask_bits(wanted)) != 0
    v = len(col.values)
    base = np.arange(blocks, dtype=np.int64) * (v + 1)
    out = np.zeros(blocks, dtype=bool)
    for c in wanted:
        keys = base + c + 1
        at = np.minimum(np.searchsorted(col.bkeys, keys), max(int(col.bkeys.size) - 1, 0))
        out |= col.bkeys[at] == keys if col.bkeys.size else False
    return out
