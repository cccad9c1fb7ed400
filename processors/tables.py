"""Compiled prefix tables: a token tree or a label trie as immutable integer arrays.

Layout (CSR). States are numbered ``0..S-1``. The outgoing edges of state ``s`` are the slice
``offsets[s]:offsets[s+1]`` of three parallel arrays:

* ``tokens``     -- the allowed token ids, sorted ascending within each state;
* ``next_state`` -- the state reached after that token: ``>= 0`` a state, ``LEAF`` (-1) a state
  with no entry (only the end token is allowed there), ``DONE`` (-2) the end token was emitted.

A transition is a search for the token among its state's sorted tokens: :meth:`MaskTables.find_edges` does it for
a whole batch at once (a comparison with every edge of every row's state while those are few, else a bisection
inside every row's slice, all rows in step: as many numpy passes as the widest state's edge count has bits). No
global ``state * V + token`` keys array is kept with the tables: at 8 bytes per edge it was the largest array of a
catalog's tables (a third of their bytes), copied into every version and sent to every replica (the vector lane
makes one for small tables where it decodes, :func:`processors.lanes._lane_keys`).

A state with no edges allows only the end token, like a missing entry (the fallback of the
tree-decode spec). The tables carry no strings, are picklable, read-only after construction, and
are versioned by a content hash.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import xxhash

from config.cancel import checkpoint

__all__ = ["DONE", "LEAF", "MaskTables", "build_tree_tables", "content_hash"]

LEAF = -1
DONE = -2


def content_hash(*parts) -> str:
    """A short, stable hex digest of arrays, strings and numbers (the version of compiled data).

    An array's bytes go in as their 128-bit xxh3 digest (not cryptographic, ten times blake2b's speed here: the
    hash of a catalog's tables is part of every PATCH's work); the version is a blake2b digest over those and the
    rest. A version names content for caches and replicas, it guards nothing: admin writes are trusted."""
    h = hashlib.blake2b(digest_size=12)
    for part in parts:
        if isinstance(part, np.ndarray):
            h.update(str(part.dtype).encode())
            h.update(str(part.shape).encode())
            h.update(xxhash.xxh3_128_digest(np.ascontiguousarray(part).data.cast("B")))  # the bytes, not copied
        else:
            h.update(repr(part).encode())
        h.update(b"\x00")
    return h.hexdigest()


def _narrow_offsets(offsets: np.ndarray) -> np.ndarray:
    """``offsets`` as int32 while the edges fit in it (every catalog under ~10^9 items), else int64: 4 bytes per
    state saved. Every array built from both compiles and from a delta goes through here, so equal tables have equal
    dtypes (and versions)."""
    if offsets.dtype != np.int32 and (not offsets.size or int(offsets[-1]) < _INT32_EDGES):
        return offsets.astype(np.int32)
    return offsets


_INT32_EDGES = 2**31 - 1
_SCALAR_ROWS = 12  # find_edges: up to this many rows, MaskTables.edge per row (~1-2 us each on this CPU)
_GATHER_EDGES = 4096  # find_edges: up to this many edges in all (or half a bisection's row rounds), compare them all


def _freeze(arr: np.ndarray) -> np.ndarray:
    arr = np.ascontiguousarray(arr)
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True)
class MaskTables:
    """Immutable CSR transition tables over token ids.

    Args:
        offsets: int64 ``(S+1,)`` edge ranges per state.
        tokens: int32 ``(E,)`` allowed token per edge, sorted within each state.
        next_state: int32 ``(E,)`` target per edge (``LEAF``/``DONE`` for the special targets).
        root: the state before the first generated token (``LEAF`` if the tree has no root entry).
        end_token_id: the token that ends a sequence; always allowed where nothing else is.
        vocab_size: the tokenizer vocabulary the ids were checked against.
        warnings: the loader's warnings about the source (the admin PUT returns them); not part of ``version``.
    """

    offsets: np.ndarray
    tokens: np.ndarray
    next_state: np.ndarray
    root: int
    end_token_id: int
    vocab_size: int
    warnings: tuple[str, ...] = field(default=(), compare=False)  # what a lenient tree load accepted; not versioned
    version: str = field(init=False)

    def __post_init__(self) -> None:
        offsets = np.asarray(self.offsets, dtype=np.int64)
        tokens = np.asarray(self.tokens, dtype=np.int32)
        next_state = np.asarray(self.next_state, dtype=np.int32)
        if offsets.ndim != 1 or offsets.size < 1 or offsets[0] != 0 or offsets[-1] != tokens.size:
            raise ValueError("offsets must start at 0 and end at the number of edges")
        if tokens.shape != next_state.shape:
            raise ValueError(f"tokens {tokens.shape} and next_state {next_state.shape} differ in shape")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got [{tokens.min()}, {tokens.max()}]")
        if not 0 <= self.end_token_id < self.vocab_size:
            raise ValueError(f"end_token_id {self.end_token_id} is outside the vocabulary of {self.vocab_size}")
        n_states = offsets.size - 1
        if not (self.root in (LEAF,) or 0 <= self.root < n_states):
            raise ValueError(f"root {self.root} is not a state")
        if tokens.size > 1:
            rising = tokens[1:] > tokens[:-1]  # within a state; a state's first edge may start lower
            starts = offsets[1:-1]
            rising[starts[(starts > 0) & (starts < tokens.size)] - 1] = True
            if not rising.all():
                raise ValueError("edges must be sorted by (state, token) without duplicates")
        object.__setattr__(self, "offsets", _freeze(_narrow_offsets(offsets)))
        object.__setattr__(self, "tokens", _freeze(tokens))
        object.__setattr__(self, "next_state", _freeze(next_state))
        object.__setattr__(
            self, "version", content_hash("tables", self.offsets, self.tokens, self.next_state, self.root, self.end_token_id, self.vocab_size)
        )
        # The per-state item metrics are computed here, where the tables are built (the config manager), so that
        # they travel with the tables and replicas share them like the other arrays; computed lazily on a replica
        # they would cost every replica their memory and the first request after a swap their time.
        item_metrics(self)

    @classmethod
    def assemble(cls, offsets: np.ndarray, tokens: np.ndarray, next_state: np.ndarray, root: int,
                 end_token_id: int, vocab_size: int, metrics: tuple, max_remaining: np.ndarray) -> "MaskTables":
        """Tables from arrays already known to be valid (``processors/kinds/tree/tables/delta.py``: a previous version's tables
        updated along the changed paths), with their item metrics: no check and no pass over all states (only the
        content hash reads every array). ``metrics``: what :func:`item_metrics` gives."""
        self = object.__new__(cls)
        for name, value in (("offsets", _narrow_offsets(offsets)), ("tokens", tokens), ("next_state", next_state)):
            object.__setattr__(self, name, _freeze(value))
        fields: dict[str, object] = {"root": int(root), "end_token_id": int(end_token_id),
                                     "vocab_size": int(vocab_size), "warnings": ()}
        for field_name, field_value in fields.items():
            object.__setattr__(self, field_name, field_value)
        object.__setattr__(self, "version", content_hash("tables", self.offsets, self.tokens, self.next_state,
                                                         self.root, self.end_token_id, self.vocab_size))
        object.__setattr__(self, "_item_metrics", metrics)
        object.__setattr__(self, "_max_remaining", max_remaining)
        return self

    def __getstate__(self) -> dict:  # the manager's own helper array stays home
        if "overlay_base" in self.__dict__:  # an overlay version travels without its base's arrays
            from processors.kinds.tree.tables.overlay import pickled

            return pickled(self)
        state = dict(self.__dict__)
        state.pop("_publish_ref", None)  # (the manager's object reference of these tables)
        state.pop("_lane_keys", None)  # (a decoding process's own search keys: processors/lanes.py)
        if state.get("_max_remaining") is not state.get("_item_metrics", (None,))[0]:  # (uniform: min_remaining)
            state.pop("_max_remaining", None)
        return state

    def __setstate__(self, state: dict) -> None:  # arrays come back writable from pickle
        if "_overlay_parts" in state:
            from processors.kinds.tree.tables.overlay import restored

            return restored(self, state)
        for name in ("offsets", "tokens", "next_state"):
            state[name] = _freeze(state[name])
        state.pop("keys", None)  # (pickled by a version that kept them)
        self.__dict__.update(state)
        from processors.kinds.tree.tables.overlay import register_base

        register_base(self)  # an overlay of these tables may follow (processors/kinds/tree/tables/overlay.py)

    @property
    def n_states(self) -> int:
        return int(self.offsets.size - 1)

    @property
    def n_edges(self) -> int:
        return int(self.tokens.size)

    @property
    def nbytes(self) -> int:
        return int(self.offsets.nbytes + self.tokens.nbytes + self.next_state.nbytes)

    def allowed(self, state: int) -> np.ndarray:
        """Allowed ids in ``state`` (empty for ``LEAF``/``DONE`` and states without edges)."""
        if state < 0:
            return self.tokens[:0]
        return self.tokens[self.offsets[state] : self.offsets[state + 1]]

    def edge(self, state: int, token: int) -> int:
        """Index of the edge ``state --token-->``, or -1 when there is none."""
        if not 0 <= state < self.offsets.size - 1 or not 0 <= token < self.vocab_size:
            return -1
        lo = int(self.offsets[state])
        row = self.tokens[lo : int(self.offsets[state + 1])]
        i = int(row.searchsorted(token))  # the method: np.searchsorted's wrapper doubles the cost of a scalar lookup
        if i < row.size and row[i] == token:
            return lo + i
        return -1

    def locate(self, states: np.ndarray, tokens: np.ndarray, side: str = "left") -> np.ndarray:
        """Per row, where ``tokens[i]`` goes among the edges of ``states[i]`` (every one a state ``>= 0``): the
        index of the first edge of that state whose token is ``>= tokens[i]`` (``side="right"``: ``>``), its end
        when there is none; ``searchsorted`` inside each row's slice, all rows at once (int64)."""
        states = np.asarray(states, dtype=np.int64)
        want = np.asarray(tokens, dtype=np.int64)
        lo = self.offsets[states].astype(np.int64)  # (int64: lo + n below must not wrap)
        n = self.offsets[states + 1] - lo  # the edges left to search, per row
        if not lo.size or not self.tokens.size:
            return lo
        return self._lower_bound(lo, n, want, side)

    def _lower_bound(self, lo: np.ndarray, n: np.ndarray, want: np.ndarray, side: str = "left") -> np.ndarray:
        """:meth:`locate` on the edges ``lo[i] : lo[i] + n[i]`` of each row (int64 arrays, not written)."""
        toks = self.tokens
        before = np.less_equal if side == "right" else np.less
        for _ in range(int(n.max()).bit_length()):  # lower_bound on every row at once, a fixed number of rounds
            half = n >> 1
            mid = lo + half
            go = before(toks.take(mid, mode="clip"), want)
            go &= n > 0
            lo = np.where(go, mid + 1, lo)
            n = np.where(go, n - half - 1, half)
        return lo

    def find_edges(self, states: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """The edge ``states[i] --tokens[i]-->`` per row, ``-1`` without one (and where ``states[i]`` is not a
        state or ``tokens[i]`` not an id of the vocabulary): :meth:`edge` for a whole batch (int64)."""
        states = np.asarray(states, dtype=np.int64)
        want = np.asarray(tokens, dtype=np.int64)
        if states.size <= _SCALAR_ROWS:  # a few rows: one slice search each beats a batch's fixed ~15 us
            edge = self.edge
            return np.fromiter(map(edge, states.tolist(), want.tolist()), dtype=np.int64, count=states.size)
        ok = (states >= 0) & (states < self.offsets.size - 1) & (want >= 0) & (want < self.vocab_size)
        if not self.tokens.size:
            return np.full(states.size, -1, dtype=np.int64)
        s = np.where(ok, states, 0) if not ok.all() else states
        lo = self.offsets[s].astype(np.int64)
        n = self.offsets[s + 1] - lo
        if s is not states:
            n[~ok] = 0
        ends = np.cumsum(n)
        if int(ends[-1]) <= max(_GATHER_EDGES, states.size * int(n.max()).bit_length() // 2):
            # few edges to compare (a label trie, a tree below its root): all of them at once, a fixed handful of
            # numpy passes, against the bisection's passes per round (as many rounds as the widest state has bits)
            rows = np.repeat(np.arange(states.size), n)
            edge = np.arange(rows.size, dtype=np.int64) + np.repeat(lo - ends + n, n)
            hit = np.flatnonzero(self.tokens[edge] == want[rows])  # at most one per row: tokens are distinct
            at = np.full(states.size, -1, dtype=np.int64)
            at[rows[hit]] = edge[hit]
            return at
        at = self._lower_bound(lo, n, want)
        ok &= at < lo + n
        ok &= self.tokens.take(at, mode="clip") == want
        return np.where(ok, at, -1)

    def step(self, state: int, token: int) -> int:
        """The state after ``token``: a state, ``LEAF``, ``DONE``, or ``LEAF`` for a token with no edge.

        The end token always leads to ``DONE``; ``DONE`` never changes.
        """
        if state == DONE or token == self.end_token_id:
            return DONE
        i = self.edge(state, token)
        return LEAF if i < 0 else int(self.next_state[i])


def build_tree_tables(tree, vocab_size: int) -> MaskTables:
    """Compile a loaded tree (``processors.kinds.tree.treefile.load.TreeData``) into :class:`MaskTables`.

    Each key becomes a state; the edge ``key --t-->`` leads to the state of ``key + sep + str(t)``
    when that key exists, to ``LEAF`` (only the end token) when it does not, and to ``DONE`` when
    ``t`` is the end token. Duplicate candidates are merged. Memory is linear in keys + candidates.

    A tree whose keys were hashed by the loader (``key_h1``/``key_h2``) compiles with array passes only: the
    edges are sorted by ``(state, token)`` in one ``np.sort``, and the target of each edge is found by extending
    its state's hashes with the token and looking the result up among the keys' hashes (a sorted merge). Other
    trees are compiled through a dict of their key strings.
    """
    offsets = np.asarray(tree.offsets, dtype=np.int64)
    cands = np.asarray(tree.candidates, dtype=np.int64)
    if cands.size and (cands.min() < 0 or cands.max() >= vocab_size):
        raise ValueError(f"candidate ids must lie in [0, {vocab_size})")
    if getattr(tree, "key_h1", None) is None:
        return _build_by_strings(tree, offsets, cands, vocab_size)
    end = int(tree.end_token_id)
    n_keys = offsets.size - 1
    base = np.int64(vocab_size)
    # edges sorted by (state, token), duplicates merged: one sort of state * V + token
    code = np.repeat(np.arange(n_keys, dtype=np.int64) * base, np.diff(offsets))
    code += cands
    code.sort()
    if code.size:
        keep = np.empty(code.size, dtype=bool)
        keep[0] = True
        np.not_equal(code[1:], code[:-1], out=keep[1:])
        if not keep.all():
            code = code[keep]
        del keep
    state = code // base
    tokens = (code - state * base).astype(np.int32)
    del code
    counts = np.bincount(state, minlength=n_keys) if n_keys else np.zeros(0, dtype=np.int64)
    new_offsets = np.zeros(n_keys + 1, dtype=np.int64)
    np.cumsum(counts, out=new_offsets[1:])
    next_state = np.full(tokens.size, LEAF, dtype=np.int32)
    next_state[tokens == end] = DONE
    _link_edges(tree, state, tokens, next_state, end)
    return MaskTables(
        offsets=new_offsets,
        tokens=tokens,
        next_state=next_state,
        root=int(tree.root_index) if tree.root_index >= 0 else LEAF,
        end_token_id=end,
        vocab_size=int(vocab_size),
        warnings=tuple(getattr(tree, "warnings", ())),
    )


def _link_edges(tree, state: np.ndarray, tokens: np.ndarray, next_state: np.ndarray, end: int) -> None:
    """Set ``next_state`` of every edge whose target path is a key (by hash), in place."""
    from processors.kinds.tree.treefile.scan import extend_hash

    h1, h2, targetable = tree.key_h1, tree.key_h2, tree.targetable
    edges = np.flatnonzero(targetable[state] & (tokens != end))  # edges from reachable-shaped states
    keys = np.flatnonzero(targetable)
    if not edges.size or not keys.size:
        return
    t1, t2 = extend_hash(h1[state[edges]], h2[state[edges]], tokens[edges])
    # Sort both sides by the high bits of h1 with the index packed into the low bits (np.sort, no argsort),
    # merge with searchsorted, then confirm on the full hashes.
    bits = max(int(max(keys.size, edges.size) - 1).bit_length(), 1)
    low = np.uint64((1 << bits) - 1)
    shift = np.uint64(bits)
    kpack = np.sort(((h1[keys] >> shift) << shift) | np.arange(keys.size, dtype=np.uint64))
    qpack = np.sort(((t1 >> shift) << shift) | np.arange(edges.size, dtype=np.uint64))
    khigh, qhigh = kpack >> shift, qpack >> shift
    kidx = keys[(kpack & low).astype(np.int64)]
    qidx = (qpack & low).astype(np.int64)
    del kpack, qpack
    pos = np.searchsorted(khigh, qhigh)
    # a query may share its high bits with several keys: try them in turn (rarely more than one)
    pending = np.arange(qidx.size)
    while pending.size:
        checkpoint()
        p = pos[pending]
        inside = p < khigh.size
        pending, p = pending[inside], p[inside]
        same = khigh[p] == qhigh[pending]
        pending, p = pending[same], p[same]
        if not pending.size:
            break
        cand = kidx[p]
        q = qidx[pending]
        hit = (h1[cand] == t1[q]) & (h2[cand] == t2[q])
        next_state[edges[q[hit]]] = cand[hit]
        pending = pending[~hit]
        pos[pending] += 1


def _build_by_strings(tree, offsets: np.ndarray, cands: np.ndarray, vocab_size: int) -> MaskTables:
    """The compile for trees whose keys were not hashed: one dict lookup of ``key + sep + str(t)`` per edge."""
    keys = tree.keys
    n_keys = len(keys)
    end = int(tree.end_token_id)
    sep = tree.sep
    index = {k: i for i, k in enumerate(keys)}
    state_of = np.repeat(np.arange(n_keys, dtype=np.int64), np.diff(offsets))
    get = index.get
    cand_list = cands.tolist()
    nxt = np.fromiter(
        (
            DONE if c == end else get(keys[s] + sep + str(c), LEAF)
            for s, c in zip(state_of.tolist(), cand_list)
        ),
        dtype=np.int64,
        count=len(cand_list),
    )
    order = np.lexsort((cands, state_of))
    state_sorted = state_of[order]
    cand_sorted = cands[order]
    nxt_sorted = nxt[order]
    if cand_sorted.size:
        keep = np.ones(cand_sorted.size, dtype=bool)
        keep[1:] = (state_sorted[1:] != state_sorted[:-1]) | (cand_sorted[1:] != cand_sorted[:-1])
        state_sorted, cand_sorted, nxt_sorted = state_sorted[keep], cand_sorted[keep], nxt_sorted[keep]
    counts = np.bincount(state_sorted, minlength=n_keys) if n_keys else np.zeros(0, dtype=np.int64)
    new_offsets = np.zeros(n_keys + 1, dtype=np.int64)
    np.cumsum(counts, out=new_offsets[1:])
    root = index.get(str(tree.start_token_id), LEAF)
    return MaskTables(
        offsets=new_offsets,
        tokens=cand_sorted.astype(np.int32),
        next_state=nxt_sorted.astype(np.int32),
        root=root,
        end_token_id=end,
        vocab_size=int(vocab_size),
        warnings=tuple(getattr(tree, "warnings", ())),
    )


# -- item metrics (per state, computed at compile time) ---------------------------------------------------------
# Owned by the retrieval work (processors/items.py, processors/tree.py). Two int32 arrays per state, built with
# vectorized passes over the edge arrays (one pass per level of the deepest path, no Python loop over states):
#
# * ``min_remaining[s]``: the fewest tokens a row in ``s`` still emits until it is finished, counting the end
#   token (a ``LEAF`` target counts 1, ``DONE`` 0; a state without edges 1);
# * ``item_count[s]``: how many items end below ``s`` (an item ends at an end-token edge, at an edge to ``LEAF``,
#   or at a state without edges).
#
# Keys are paths, so every state has at most one incoming edge (a forest) and the passes converge after as many
# rounds as the deepest path has edges.

_UNSET = np.iinfo(np.int32).max


def _item_metrics(tables: "MaskTables") -> tuple[np.ndarray, np.ndarray, bool, int]:
    """The same values as the reference in ``tests/unit/test_tree_lenient.py`` (every edge each round until nothing changes), with each state and edge visited once: states are settled
    leaves first (a state is ready once every state its edges lead to is settled; the edges form a forest), so the
    work is O(states + edges) instead of one pass over all edges per level of the deepest path."""
    n_states = tables.n_states
    offsets = tables.offsets
    nxt = tables.next_state
    counts = np.diff(offsets)
    min_rem = np.ones(n_states, dtype=np.int64)  # a state without edges: the end token only
    max_rem = np.ones(n_states, dtype=np.int64)
    items = np.ones(n_states, dtype=np.int64)
    if n_states == 0:
        return _freeze(min_rem.astype(np.int32)), _freeze(items.astype(np.int32)), True, 1
    to_state = nxt >= 0
    state_of_edge = np.repeat(np.arange(n_states, dtype=np.int64), counts)
    parent = np.full(n_states, -1, dtype=np.int64)
    parent[nxt[to_state]] = state_of_edge[to_state]
    del state_of_edge
    pending = np.bincount(parent[parent >= 0], minlength=n_states)  # edges into states not settled yet
    ready = np.flatnonzero(pending == 0)
    special_min = np.where(nxt == DONE, 0, 1)
    while ready.size:
        checkpoint()  # one level each: a deep tree is stoppable (config.cancel)
        c = counts[ready]
        has = c > 0
        rs, rc = ready[has], c[has]
        if rs.size:
            starts = np.zeros(rs.size, dtype=np.int64)
            np.cumsum(rc[:-1], out=starts[1:])
            edges = np.repeat(offsets[rs] - starts, rc) + np.arange(int(rc.sum()), dtype=np.int64)
            target = nxt[edges]
            inner = target >= 0
            tgt = np.maximum(target, 0)
            e_min = np.where(inner, min_rem[tgt], special_min[edges])
            e_max = np.where(inner, max_rem[tgt], special_min[edges])
            e_items = np.where(inner, items[tgt], 1)
            min_rem[rs] = np.minimum(np.minimum.reduceat(e_min, starts) + 1, _UNSET)
            max_rem[rs] = np.minimum(np.maximum.reduceat(e_max, starts) + 1, _UNSET)
            items[rs] = np.add.reduceat(e_items, starts)
        up = parent[ready]
        up = up[up >= 0]
        if not up.size:
            break
        uniq, hits = np.unique(up, return_counts=True)
        pending[uniq] -= hits
        ready = uniq[pending[uniq] == 0]
    uniform = bool(np.array_equal(min_rem, max_rem))
    deepest = int(max_rem.max())
    min_out = _freeze(min_rem.astype(np.int32))
    # the longest way down per state: what a delta (processors/kinds/tree/tables/delta.py) needs to update `uniform`/`deepest`;
    # in a uniform tree (every fixed-depth catalog) it is min_remaining itself, kept once (4 bytes per state)
    tables.__dict__["_max_remaining"] = min_out if uniform else _freeze(np.minimum(max_rem, _UNSET).astype(np.int32))
    return min_out, _freeze(np.minimum(items, np.iinfo(np.int32).max).astype(np.int32)), uniform, deepest


def item_metrics(tables: "MaskTables") -> tuple[np.ndarray, np.ndarray, bool, int]:
    """``(min_remaining, item_count, uniform, deepest)`` of ``tables``, computed once and kept on the tables (see above)."""
    cached = tables.__dict__.get("_item_metrics")
    if cached is None:
        cached = _item_metrics(tables)
        object.__setattr__(tables, "_item_metrics", cached)
    return cached


MaskTables.min_remaining = property(lambda self: item_metrics(self)[0])  # type: ignore[attr-defined]
MaskTables.item_count = property(lambda self: item_metrics(self)[1])  # type: ignore[attr-defined]
