"""Per-request item controls for tree and label rows (generative retrieval).

An *item* is one way through a tree (or label trie) from the root to its end: the tokens after the root up to an
end-token edge, up to an edge into ``LEAF``, or up to a state without edges. Every item has a *terminal id*: the
index of its last edge (the end-token edge or the edge into ``LEAF``), or ``n_edges + state`` for a state without
edges. The compiled tables carry, per state, ``item_count`` (items below it) and ``min_remaining`` (fewest tokens
still to emit, counting the end token); see :mod:`processors.tables`.

What a request may ask (``docs/design.md``, "Item controls"):

* ``exclude``: items that must not be produced. They are walked once at admission into an :class:`ItemBook`:
  ``counts[s]`` = how many excluded items lie below state ``s``, ``ends`` = their terminal ids.
* ``distinct``: the rows of one request produce different items. They share one book; a row *occupies* one item
  below every state on its current path (``counts[s] += 1`` when it enters ``s``) and turns it into a taken item
  when its item ends. A token into state ``n`` is allowed only while ``item_count[n] - counts[n] >= 1``, so every
  row always has an item left to finish (no dead end), and two rows never finish the same item.
* multi-item sequences (scenario fields ``max_items``, ``separator_token_id``): a row's own earlier items are in a
  book of its own (or in the shared one under ``distinct``), with the same rule.

A token is then allowed in state ``s`` iff its edge's target still has a free item (``item_count - taken >= 1``;
for an end or ``LEAF`` edge: its terminal id is not taken) and the shortest way from the target to an item's end
fits in the tokens left (``min_remaining <= remaining``). Work per step: a few array operations over the state's
candidates plus one ``searchsorted`` into the book's sorted keys; per finished item, O(item length).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .tables import LEAF, MaskTables, item_metrics

__all__ = ["DenseBook", "ItemBook", "ItemRequest", "ItemRules", "item_rules", "min_item_tokens", "resolve_exclude"]


class ItemBook:
    """Items taken: per state, how many taken (or occupied) items lie below it; and the taken terminal ids."""

    __slots__ = ("counts", "ends", "_keys", "_vals", "_end_arr")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.ends: set[int] = set()
        self._keys: np.ndarray | None = None
        self._vals: np.ndarray | None = None
        self._end_arr: np.ndarray | None = None

    def __bool__(self) -> bool:
        return bool(self.counts) or bool(self.ends)

    def copy(self) -> "ItemBook":
        new = ItemBook()
        new.counts = dict(self.counts)
        new.ends = set(self.ends)
        return new

    def add(self, states: Sequence[int] | int, n: int = 1) -> None:
        counts = self.counts
        for s in [states] if isinstance(states, int) else states:
            counts[s] = counts.get(s, 0) + n
        self._keys = None

    def add_end(self, terminal: int) -> None:
        if terminal not in self.ends:
            self.ends.add(terminal)
            self._end_arr = None

    def count(self, state: int) -> int:
        return self.counts.get(state, 0)

    def lookup(self, states: np.ndarray) -> np.ndarray:
        """``counts`` for each entry of ``states`` (0 where absent; negative entries give 0)."""
        if not self.counts:
            return np.zeros(states.shape, dtype=np.int64)
        if (self._keys is None or self._vals is None) and states.size * 16 < len(self.counts):
            # the sorted copy is stale (a distinct row just moved) and rebuilding it costs more than a few dict
            # lookups: look the candidates up directly
            get = self.counts.get
            return np.fromiter((get(s, 0) for s in states.tolist()), dtype=np.int64, count=states.size)
        if self._keys is None or self._vals is None:
            k = np.fromiter(self.counts.keys(), dtype=np.int64, count=len(self.counts))
            v = np.fromiter(self.counts.values(), dtype=np.int64, count=len(self.counts))
            order = np.argsort(k)
            self._keys, self._vals = k[order], v[order]
        keys, vals = self._keys, self._vals
        idx = np.minimum(keys.searchsorted(states), keys.size - 1)
        return np.where(keys[idx] == states, vals[idx], 0)

    def ends_taken(self, terminals: np.ndarray) -> np.ndarray:
        """Bool per entry: is that terminal id taken."""
        if not self.ends:
            return np.zeros(terminals.shape, dtype=bool)
        if self._end_arr is None:
            self._end_arr = np.sort(np.fromiter(self.ends, dtype=np.int64, count=len(self.ends)))
        arr = self._end_arr
        idx = np.minimum(arr.searchsorted(terminals), arr.size - 1)
        return arr[idx] == terminals


class _Marked:
    """``x in marked``: a bool array read as a set of indices."""

    __slots__ = ("flags",)

    def __init__(self, flags: np.ndarray):
        self.flags = flags

    def __contains__(self, index: object) -> bool:
        return isinstance(index, (int, np.integer)) and 0 <= int(index) < self.flags.size and bool(self.flags[index])


class DenseBook:
    """A fixed set of items left out, as arrays over the whole tables (the items a filter does not pass, in the
    whole-tables form: :func:`processors.kinds.tree.filters.edges.filter_book`; the service reads a lazily resolved
    filter through the same interface, :class:`processors.kinds.tree.filters.lazy.FilterView`): ``counts[s]`` items
    below state ``s``, ``ends`` their terminals. Read like an :class:`ItemBook`, never written."""

    __slots__ = ("counts_array", "ends", "_padded", "_edge_ok")

    def __init__(self, counts: np.ndarray, ends: np.ndarray, edge_ok: tuple[MaskTables, np.ndarray] | None = None):
        self.counts_array = counts
        self.ends = _Marked(ends)
        # two zeros after the states: LEAF (-1) and DONE (-2) targets read them, one gather per lookup
        self._padded = np.concatenate((counts, np.zeros(2, dtype=counts.dtype)))
        # (tables, the edge mask over them) when its builder had it already (else made at the first edge_ok)
        self._edge_ok: tuple[int, np.ndarray] | None = None if edge_ok is None else (id(edge_ok[0]), edge_ok[1])

    def edge_ok(self, tables: MaskTables) -> np.ndarray:
        """``bool`` per edge of ``tables`` (the ones this book was built on): a row may take the edge (a free item
        lies below its target, or the item it ends is not left out): what the cursor's own step computes for one
        state (``TreeCursor._filter``), for every edge at once; made once per book (the vector lane's gather)."""
        if self._edge_ok is None or self._edge_ok[0] != id(tables):
            nxt = tables.next_state.astype(np.int64)
            inner = nxt >= 0
            item_count = item_metrics(tables)[1]
            ok = ~self.ends.flags[:tables.n_edges].copy()
            target = nxt[inner]
            ok[inner] = item_count[target] - self.counts_array[target] >= 1
            self._edge_ok = (id(tables), ok)
        return self._edge_ok[1]

    def edges_ok(self, tables: MaskTables, edges: np.ndarray) -> np.ndarray:
        """:meth:`edge_ok` at ``edges`` (the interface a lazily resolved filter answers too:
        :class:`processors.kinds.tree.filters.lazy.FilterView`)."""
        return self.edge_ok(tables)[edges]

    def __bool__(self) -> bool:
        return True

    def count(self, state: int) -> int:
        return int(self.counts_array[state]) if state >= 0 else 0

    def lookup(self, states: np.ndarray) -> np.ndarray:
        return self._padded[states]

    def ends_taken(self, terminals: np.ndarray) -> np.ndarray:
        """Bool per entry (terminal ids of the tables: edges, or ``n_edges + state``)."""
        return self.ends.flags[terminals]


@dataclass(frozen=True)
class ItemRules:
    """A scenario's multi-item settings: up to ``max_items`` items per row, joined by ``separator_token_id`` (or
    back to back when it is ``None``: the fixed-width form)."""

    max_items: int = 1
    separator_token_id: int | None = None


def item_rules(compiled) -> ItemRules:
    """The multi-item settings of a :class:`~processors.compile.CompiledScenario` (its ``settings``)."""
    settings = getattr(compiled, "settings", None) or {}
    return ItemRules(int(settings.get("max_items", 1)), settings.get("separator_token_id"))


class ItemRequest:
    """One request's item controls, shared by its rows: the book of excluded (and, with ``distinct``, taken and
    occupied) items. Build it with :func:`resolve_exclude`; pass the same object to every row of the request."""

    __slots__ = ("book", "distinct", "n_excluded", "base", "filter")

    def __init__(self, book: ItemBook | None = None, distinct: bool = False, n_excluded: int = 0,
                 base: DenseBook | None = None, filter: Any = None):  # noqa: A002 - the request's field name
        self.book = book if book is not None else ItemBook()
        self.distinct = bool(distinct)
        self.n_excluded = n_excluded
        self.base = base  # the items the request's filter leaves out (shared, read only)
        self.filter = filter  # the request's own filter as sent (None: the scenario's alone), to resolve elsewhere


def _tables_of(constraint) -> MaskTables:
    tables = getattr(constraint, "tables", constraint)
    if not isinstance(tables, MaskTables):
        raise TypeError(f"item controls need a tree or label scenario, got {type(constraint).__name__}")
    return tables


def terminal_of(tables: MaskTables, state: int, last_edge: int) -> int | None:
    """The terminal id of the item a row completes in ``state`` (``LEAF`` after ``last_edge``), or ``None`` when
    no item ends there."""
    if state == LEAF:
        return last_edge if last_edge >= 0 else None
    if state < 0:
        return None
    lo, hi = int(tables.offsets[state]), int(tables.offsets[state + 1])
    if lo == hi:
        return tables.n_edges + state
    e = tables.edge(state, tables.end_token_id)
    return e if e >= 0 else None


def walk_item(tables: MaskTables, tokens: Sequence[int]) -> tuple[list[int], int] | None:
    """The states an item passes (root first) and its terminal id; ``None`` when ``tokens`` is not an item."""
    state = tables.root
    if state < 0:
        return None
    path = [state]
    last = -1
    for t in tokens:
        if state < 0:
            return None
        e = tables.edge(state, int(t))
        if e < 0 or int(t) == tables.end_token_id:
            return None
        last = e
        state = int(tables.next_state[e])
        if state >= 0:
            path.append(state)
    term = terminal_of(tables, state, last)
    return (path, term) if term is not None else None


def _label_paths(constraint) -> dict[str, list[int]]:
    """Label -> its token ids in the trie (from the trie itself, so it matches what rows emit)."""
    cached = constraint.__dict__.get("_label_token_paths")
    if cached is not None:
        return cached
    tables = constraint.tables
    parent = np.full(tables.n_states, -1, dtype=np.int64)
    parent_tok = np.full(tables.n_states, -1, dtype=np.int64)
    nxt = tables.next_state.astype(np.int64)
    src = np.repeat(np.arange(tables.n_states, dtype=np.int64), np.diff(tables.offsets))
    m = nxt >= 0
    parent[nxt[m]] = src[m]
    parent_tok[nxt[m]] = tables.tokens[m]
    out: dict[str, list[int]] = {}
    for state, label_index in enumerate(constraint.terminal.tolist()):
        if label_index < 0:
            continue
        toks = []
        s = state
        while parent[s] >= 0:
            toks.append(int(parent_tok[s]))
            s = int(parent[s])
        out[constraint.labels[label_index]] = toks[::-1]
    object.__setattr__(constraint, "_label_token_paths", out)
    return out


def resolve_exclude(constraint, exclude: Sequence[Any] | None, *, distinct: bool = False,
                    field: str = "exclude") -> ItemRequest:
    """Walk each excluded item once into a fresh :class:`ItemRequest`.

    ``constraint``: :class:`MaskTables` (items are token-id lists after the root, without the end token) or
    :class:`~processors.labels.LabelTables` (items are label strings). Raises ``ValueError`` naming
    ``field[i]`` for an item of the wrong type or one that is not in the catalog (an unknown item is an error,
    not ignored: a typo or a stale id would otherwise pass silently). Repeated items count once.
    """
    tables = _tables_of(constraint)
    book = ItemBook()
    labels = constraint is not tables
    seen: set = set()
    for i, item in enumerate(exclude or ()):
        if labels:
            if not isinstance(item, str):
                raise ValueError(f"{field}[{i}]: a label scenario excludes labels (strings), got {type(item).__name__}")
            toks = _label_paths(constraint).get(item)
            if toks is None:
                raise ValueError(f"{field}[{i}]: {item!r} is not a label of this scenario")
            key: Any = item
        else:
            if not isinstance(item, (list, tuple)) or not all(type(t) is int for t in item):
                raise ValueError(f"{field}[{i}]: a tree item is a list of token ids (the tokens after the root, "
                                 f"without the end token), got {item!r:.80}")
            toks = list(item)
            key = tuple(toks)
        if key in seen:
            continue
        seen.add(key)
        walked = walk_item(tables, toks)
        if walked is None:
            raise ValueError(f"{field}[{i}]: {item!r:.80} is not an item of this scenario (no path from the root "
                             "that ends there)")
        path, term = walked
        book.add(path)
        book.add_end(term)
    return ItemRequest(book, distinct, len(seen))


def min_item_tokens(constraint) -> int:
    """Fewest tokens of one item (without the end token): the smallest ``max_new_tokens`` that fits an item."""
    tables = _tables_of(constraint)
    if tables.root < 0:
        return 1
    return max(int(item_metrics(tables)[0][tables.root]) - 1, 1)
