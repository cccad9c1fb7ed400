"""The tables of a large catalog compiled in bounded memory: the trie cut under its root into subtrees.

A whole compile (:func:`processors.kinds.tree.tables.trie.whole_tables` on every item at once) peaks at a few
hundred bytes per item (the padded matrix and its sort, or a level of ``_Trie``): 2.6 GB at 10^7 items, beyond this
machine's memory at 10^8. The subtrees under the root's edges are independent, and the tables number states in
preorder with siblings by token, so the tables of a catalog are its root's edges followed by the tables of each
first token's subtree, in token order, their states shifted. :func:`chunked_tables` groups the first tokens into
chunks of at most ``chunk_ids`` ids (a counting pass per token, then one stable sort of a small chunk number per
item), compiles each chunk whole and appends its states but its root; a single first token with more ids than that
is compiled as its suffix catalog (its items less that token), cut again the same way. The item metrics of every
state come with its chunk (they depend only on the states below it); the root's are computed from its edges.

The peak is the items, one int64 start and one sort index per item, one chunk's compile and the tables being
filled, so it no longer grows with the items' compile. The result is byte for byte the whole compile's (same arrays,
same version, same item metrics; ``tests/unit/test_catalog_chunks.py`` compares them on random catalogs cut into
chunks of a few ids).
"""

from __future__ import annotations

import numpy as np

from config.cancel import checkpoint
from processors.kinds.tree.tables.trie import whole_tables
from processors.tables import DONE, LEAF, MaskTables, _freeze, item_metrics

__all__ = ["CHUNK_IDS", "chunked_tables"]

#: ids compiled at once (about 2 * 10^6 4-token items: a chunk's compile peaks near 0.7 GB)
CHUNK_IDS = 1 << 23
_UNSET = np.iinfo(np.int32).max


class _Items:
    """A catalog's items as arrays (what ``catalog_tables`` reads)."""

    def __init__(self, start: int, end: int, flat: np.ndarray, lengths: np.ndarray):
        self.start_token_id, self.end_token_id, self.flat, self.lengths = start, end, flat, lengths

    def __len__(self) -> int:
        return int(self.lengths.size)


def chunked_tables(catalog, vocab_size: int, chunk_ids: int = CHUNK_IDS) -> MaskTables:
    """The tables of ``catalog`` (a :class:`~processors.kinds.tree.tables.trie.CatalogItems` of distinct items),
    compiled in chunks of at most about ``chunk_ids`` ids: byte for byte what ``catalog_tables`` gives."""
    flat = np.asarray(catalog.flat)
    lengths = np.asarray(catalog.lengths)
    out = _Builder(catalog.start_token_id, catalog.end_token_id, int(vocab_size), max(int(chunk_ids), 1))
    if flat.size <= out.chunk_ids:
        return out._whole(flat, lengths)
    root, _ = out.compile(flat, lengths)
    return out.assemble(root)


class _Builder:
    def __init__(self, start: int, end: int, vocab: int, chunk_ids: int):
        self.start, self.end, self.vocab, self.chunk_ids = start, end, vocab, chunk_ids
        self.parts: list[list] = []  # one per root placeholder or per compiled block of states
        self.n_states = 0

    # -- the pieces ------------------------------------------------------------------------------------------
    def _whole(self, flat: np.ndarray, lengths: np.ndarray) -> MaskTables:
        return whole_tables(_Items(self.start, self.end, flat, lengths), self.vocab)

    def _append(self, tables: MaskTables, first: int) -> int:
        """Appends the states of ``tables`` from ``first`` (0: all; 1: all but its root) after the states so far;
        returns the shift of its state numbers."""
        shift = self.n_states - first
        offsets = np.asarray(tables.offsets, dtype=np.int64)
        lo = int(offsets[first])
        nxt = np.array(tables.next_state[lo:], dtype=np.int32)
        nxt[nxt >= 0] += shift
        min_rem, items, _, _ = item_metrics(tables)
        max_rem = tables.__dict__["_max_remaining"]
        self.parts.append([np.diff(offsets[first:]), np.asarray(tables.tokens[lo:]), nxt, min_rem[first:],
                           max_rem[first:], items[first:]])
        self.n_states += tables.n_states - first
        return shift

    def _metrics(self, tables: MaskTables, state: int) -> tuple[int, int, int]:
        min_rem, items, _, _ = item_metrics(tables)
        return int(min_rem[state]), int(tables.__dict__["_max_remaining"][state]), int(items[state])

    # -- a catalog of suffixes ---------------------------------------------------------------------------------
    def compile(self, flat: np.ndarray, lengths: np.ndarray) -> tuple[int, tuple[int, int, int]]:
        """Appends the states of the tree of these items (root first, preorder) to the parts; returns the root's
        global state (``LEAF`` when the tree has no state) and its metrics (min, max, items)."""
        checkpoint()
        if flat.size <= self.chunk_ids:
            tables = self._whole(flat, lengths)
            if tables.root == LEAF:  # no state: the items are at most the empty one
                return LEAF, (1, 1, 1)
            metrics = self._metrics(tables, 0)
            return self._append(tables, 0), metrics
        root = self.n_states
        slot = len(self.parts)
        self.parts.append([])  # the root's edges, filled once every chunk is compiled
        self.n_states += 1
        edges: list[tuple] = []  # per chunk, the root's edges into it: (tokens, targets, their min, max, items)
        if (lengths == 0).any():  # the empty item: the root's end edge
            edges.append(tuple(np.array([v]) for v in (self.end, DONE, 0, 0, 1)))
        starts = np.zeros(lengths.size, dtype=np.int64)
        if lengths.size > 1:
            np.cumsum(lengths[:-1], out=starts[1:])
        going = np.flatnonzero(lengths > 0)
        first_tok = flat[starts[going]]
        for kind, toks, members in self._chunks(first_tok, lengths[going]):
            checkpoint()
            items = going[members]
            if kind == "deep":  # one first token with more ids than a chunk: its suffix catalog, cut again
                sub_flat, sub_len = _gather(flat, starts[items] + 1, lengths[items].astype(np.int64) - 1)
                state, (lo_, hi_, n_) = self.compile(sub_flat, sub_len.astype(lengths.dtype))
                del sub_flat
                edges.append(tuple(np.array([v]) for v in (toks[0], state, lo_, hi_, n_)))
                continue
            sub_flat, sub_len = _gather(flat, starts[items], lengths[items].astype(np.int64))
            tables = self._whole(sub_flat, sub_len.astype(lengths.dtype))
            del sub_flat
            lo, hi = int(tables.offsets[0]), int(tables.offsets[1])  # the chunk's root: its first tokens
            nxt = np.asarray(tables.next_state[lo:hi], dtype=np.int64)
            inner = nxt >= 0
            min_rem, items_n, _, _ = item_metrics(tables)
            max_rem = tables.__dict__["_max_remaining"]
            tgt = np.maximum(nxt, 0)
            toks_in = np.asarray(tables.tokens[lo:hi])
            shift = self._append(tables, 1)
            edges.append((toks_in, np.where(inner, nxt + shift, nxt), np.where(inner, min_rem[tgt], 1),
                          np.where(inner, max_rem[tgt], 1), np.where(inner, items_n[tgt], 1)))
        tok, tgt, e_min, e_max, e_items = (np.concatenate(column) for column in zip(*edges))
        order = np.argsort(tok, kind="stable")
        metrics = (min(int(e_min.min()) + 1, _UNSET), min(int(e_max.max()) + 1, _UNSET),
                   min(int(e_items.sum()), _UNSET))
        self.parts[slot] = [np.array([tok.size], dtype=np.int64), tok[order].astype(np.int32),
                            tgt[order].astype(np.int32), np.array([metrics[0]], np.int32),
                            np.array([metrics[1]], np.int32), np.array([metrics[2]], np.int32)]
        return root, metrics

    def _chunks(self, first_tok: np.ndarray, lengths: np.ndarray):
        """The chunks of the root's subtrees, in token order: ``("whole" | "deep", tokens, member indices)``; a
        chunk is a run of first tokens whose items hold at most ``chunk_ids`` ids together, or one token alone
        whose items hold more ("deep")."""
        ids_per_token = np.bincount(first_tok, weights=lengths, minlength=1)
        toks = np.flatnonzero(ids_per_token)
        sizes = ids_per_token[toks]
        chunk_of = np.zeros(ids_per_token.size, dtype=np.int64)
        plan: list[tuple[str, list[int]]] = []
        run: list[int] = []
        run_ids = 0.0
        for t, size in zip(toks.tolist(), sizes.tolist()):
            if size > self.chunk_ids or run_ids + size > self.chunk_ids:
                if run:
                    plan.append(("whole", run))
                run, run_ids = [], 0.0
            if size > self.chunk_ids:
                plan.append(("deep", [t]))
                continue
            run.append(t)
            run_ids += size
        if run:
            plan.append(("whole", run))
        for i, (_, members) in enumerate(plan):
            chunk_of[members] = i
        # one stable sort of a small number per item (a radix sort for uint16) groups the items by chunk
        item_chunk = chunk_of[first_tok].astype(np.uint16 if len(plan) <= 1 << 16 else np.int64)
        order = np.argsort(item_chunk, kind="stable")
        bounds = np.zeros(len(plan) + 1, dtype=np.int64)
        np.cumsum(np.bincount(item_chunk, minlength=len(plan)), out=bounds[1:])
        del item_chunk
        for i, (kind, members) in enumerate(plan):
            yield kind, members, order[bounds[i]:bounds[i + 1]]

    # -- the result ------------------------------------------------------------------------------------------
    def assemble(self, root: int) -> MaskTables:
        n_edges = sum(int(p[1].size) for p in self.parts)
        offsets = np.zeros(self.n_states + 1, dtype=np.int64)
        tokens = np.empty(n_edges, dtype=np.int32)
        next_state = np.empty(n_edges, dtype=np.int32)
        min_rem = np.empty(self.n_states, dtype=np.int32)
        max_rem = np.empty(self.n_states, dtype=np.int32)
        items = np.empty(self.n_states, dtype=np.int32)
        s = e = 0
        while self.parts:  # each part copied in and let go (the peak is the tables and one part)
            counts, tok, nxt, lo, hi, n = self.parts.pop(0)
            k, m = int(counts.size), int(tok.size)
            np.cumsum(counts, out=offsets[s + 1:s + 1 + k])
            offsets[s + 1:s + 1 + k] += e
            tokens[e:e + m], next_state[e:e + m] = tok, nxt
            min_rem[s:s + k], max_rem[s:s + k], items[s:s + k] = lo, hi, n
            s, e = s + k, e + m
        uniform = bool(np.array_equal(min_rem, max_rem))
        min_out = _freeze(min_rem)
        max_out = min_out if uniform else _freeze(max_rem)
        metrics = (min_out, _freeze(items), uniform, int(max_rem[root]))
        return MaskTables.assemble(offsets, tokens, next_state, root, self.end, self.vocab, metrics, max_out)


def _gather(flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ids of the items that start at ``starts`` with ``lengths``, concatenated."""
    if not lengths.size:
        return flat[:0].copy(), lengths
    width = int(lengths[0])
    if (lengths == width).all():  # (fixed-depth ids, the common case: one 2-D gather)
        index = starts[:, None] + np.arange(width, dtype=np.int64)[None, :]
        return flat[index.reshape(-1)], lengths
    ends = np.cumsum(lengths)
    index = np.repeat(starts - (ends - lengths), lengths) + np.arange(int(ends[-1]), dtype=np.int64)
    return flat[index], lengths
