"""The tables of a catalog (a token tree given as its items), built straight from the items with array passes.

A catalog (``processors/kinds/tree/catalog/catalog.py``: the items format of ``PUT /admin/scenarios/{name}`` with
``Content-Type: application/x-ndjson``) is a list of items, each the token ids after the root, without the end
token. :func:`whole_tables` gives the compiled :class:`~processors.tables.MaskTables` of the tree those items
spell; :func:`tree_file_bytes` gives that tree in the tree file format (:mod:`processors.kinds.tree.treefile.load`). Both build the
same trie (:class:`_Trie`: built level by level over the flat ids, no padded matrix, so time and memory follow the
total number of ids rather than items x longest item; nodes numbered in preorder, so a parent comes before its
children), so the tables equal those of the tree file once loaded (``tests/unit/test_catalog_tables.py`` compares
both on random catalogs; ``tests/unit/test_catalog_tables_rewrite.py`` compares both with the padded-matrix build
they replaced). See docs/design.md section 4.3.

The items come as a :class:`CatalogItems`: any object with ``start_token_id``, ``end_token_id``, ``flat`` (every
item's ids, concatenated) and ``lengths`` (each item's length), and ``len()`` (the item count).
"""

from __future__ import annotations

import json
from typing import Protocol

import numpy as np

from config.cancel import checkpoint
from processors.tables import DONE, LEAF, MaskTables

__all__ = ["CatalogItems", "tree_file_bytes", "whole_tables"]


class CatalogItems(Protocol):
    """The items of a catalog as arrays (``processors.kinds.tree.catalog.catalog.Catalog`` is one)."""

    start_token_id: int
    end_token_id: int

    @property
    def flat(self) -> np.ndarray: ...

    @property
    def lengths(self) -> np.ndarray: ...

    def __len__(self) -> int: ...


class _Trie:
    """The trie of a catalog's items, built level by level over the items' flat ids (no padded matrix): at depth
    ``d`` the items longer than ``d`` give the keys ``parent * K + token[d]``, whose ``np.unique`` gives the nodes of
    depth ``d + 1`` in lexicographic order, so time and memory follow the total number of ids, not items x longest
    item. The nodes are then numbered in preorder (a prefix before its extensions, siblings by token): the order
    of the padded-matrix build this replaces (items sorted as rows, a node numbered where a row first differs from
    the row before), so the states, edges and tree file bytes are the same.

    Per node (preorder id): ``parent`` (-1 for the root), ``token`` (the id on the edge from the parent),
    ``depth``, ``start`` (where a path through it starts in ``flat``: its first ``depth`` ids are the node's
    prefix), ``has_child``, ``is_end`` (the prefix is an item)."""

    def __init__(self, catalog: CatalogItems):
        n = len(catalog)
        lengths = np.asarray(catalog.lengths, dtype=np.int64)
        flat = np.asarray(catalog.flat)
        starts = np.zeros(n, dtype=np.int64)
        if n > 1:
            np.cumsum(lengths[:-1], out=starts[1:])
        k = np.int64(max(int(flat.max(initial=0)), 0) + 1)
        # level by level: per level, the nodes' parent (index in the level above), token, a path start, end flag
        parents, tokens, reps, ends = [np.zeros(1, np.int64)], [np.zeros(1, np.int64)], [np.zeros(1, np.int64)], []
        items = np.arange(n, dtype=np.int64)  # the items still going, and the node each is at (level index)
        at = np.zeros(n, dtype=np.int64)
        d = 0
        tail = None  # (depth, node at that depth, item): one item goes on alone from there, a chain made at once
        while True:
            checkpoint()  # a level each (config.cancel)
            done = lengths[items] == d
            end_flag = np.zeros(parents[-1].size, dtype=bool)
            end_flag[at[done]] = True
            ends.append(end_flag)
            items, at = items[~done], at[~done]
            if items.size == 0:
                break
            if items.size == 1:  # (a long item alone would cost a level each)
                tail = (d, int(at[0]), int(items[0]))
                break
            key = at * k + flat[starts[items] + d]
            uniq, first, inverse = np.unique(key, return_index=True, return_inverse=True)
            parents.append(uniq // k)
            tokens.append(uniq % k)
            reps.append(starts[items[first]])
            at = inverse.reshape(-1).astype(np.int64)
            d += 1
        # preorder ids: subtree sizes bottom-up, then each node's id from its parent's, level by level top-down
        sizes = [np.ones(p.size, dtype=np.int64) for p in parents]
        chain = 0 if tail is None else int(lengths[tail[2]]) - tail[0]
        if tail is not None:
            sizes[tail[0]][tail[1]] += chain
        for level in range(len(parents) - 1, 0, -1):
            sizes[level - 1] += np.bincount(parents[level], weights=sizes[level],
                                            minlength=parents[level - 1].size).astype(np.int64)
        ids = [np.zeros(1, dtype=np.int64)]
        for level in range(1, len(parents)):
            par, size = parents[level], sizes[level]
            before = np.cumsum(size) - size  # the sizes of the earlier nodes of this level...
            group_first = np.flatnonzero(np.concatenate(([True], par[1:] != par[:-1])))
            first_of = np.repeat(group_first, np.diff(np.append(group_first, par.size)))
            before -= before[first_of]  # ...of the same parent (siblings are contiguous, by token)
            ids.append(ids[level - 1][par] + 1 + before)
        total = int(sizes[0][0])
        self.n_nodes = total
        self.parent = np.full(total, -1, dtype=np.int64)
        self.token = np.zeros(total, dtype=np.int64)
        self.depth = np.zeros(total, dtype=np.int64)
        self.start = np.zeros(total, dtype=np.int64)
        self.is_end = np.zeros(total, dtype=bool)
        for level, node in enumerate(ids):
            if level:
                self.parent[node] = ids[level - 1][parents[level]]
                self.token[node] = tokens[level]
            self.depth[node] = level
            self.start[node] = reps[level]
            self.is_end[node] = ends[level]
        if tail is not None:  # the chain right after its first node (its only child), in depth order
            d, top, item = tail
            node = int(ids[d][top]) + 1 + np.arange(chain, dtype=np.int64)
            self.parent[node] = node - 1
            self.parent[node[0]] = ids[d][top]
            self.token[node] = flat[starts[item] + d:starts[item] + d + chain]
            self.depth[node] = np.arange(d + 1, d + 1 + chain)
            self.start[node] = starts[item]
            self.is_end[node[-1]] = True
        self.has_child = np.zeros(total, dtype=bool)
        self.has_child[self.parent[1:]] = True
        self.flat = flat


def tree_file_bytes(catalog: CatalogItems) -> bytes:
    """The tree (tree file format) whose paths are the catalog's items: a state per prefix that has a
    continuation, the end token among its candidates when that prefix is an item itself. A prefix without a
    continuation has no key: the tree format then allows only the end token there.

    The trie is built level by level (:class:`_Trie`, no padded matrix); only the key texts are made per state,
    each from the ids of an item through it."""
    head = json.dumps({"start_token_id": catalog.start_token_id, "end_token_id": catalog.end_token_id,
                       "sep": "_"})[:-1] + ',"prefix_dict":{'
    blocks = [head.encode("ascii")]
    if len(catalog):
        trie = _Trie(catalog)
        internal = np.flatnonzero(trie.has_child)  # states with a continuation: keys, in preorder
        # candidates of every internal state: its children's tokens (ascending), then the end token where the
        # prefix is an item
        children = np.arange(1, trie.n_nodes)  # preorder: siblings come by token
        ends_at = internal[trie.is_end[internal]]
        cand_state = np.concatenate((trie.parent[children], ends_at))
        cand_code = np.concatenate((trie.token[children], np.full(ends_at.size, catalog.end_token_id, dtype=np.int64)))
        order = np.argsort(cand_state, kind="stable")
        cand_code = cand_code[order]
        text = _KeyWriter(max(int(trie.flat.max(initial=0)), catalog.start_token_id, catalog.end_token_id) + 1)
        slot = np.zeros(trie.n_nodes, dtype=np.int64)
        slot[internal] = np.arange(internal.size)
        n_cands = np.bincount(slot[cand_state], minlength=internal.size)
        cand_offsets = np.concatenate(([0], np.cumsum(n_cands)))
        for lo in range(0, internal.size, _TEXT_BLOCK):  # a block of states at a time (bounded memory)
            checkpoint()
            states = internal[lo:lo + _TEXT_BLOCK]
            counts = n_cands[lo:lo + states.size]
            first, last = int(cand_offsets[lo]), int(cand_offsets[lo + states.size])
            blocks.append(text.block(catalog.start_token_id, trie.flat, trie.start[states], trie.depth[states],
                                     cand_code[first:last], counts, final=lo + _TEXT_BLOCK >= internal.size))
    blocks.append(b"}}")
    return b"".join(blocks)


def whole_tables(catalog: CatalogItems, vocab_size: int) -> MaskTables:
    """The compiled tables (:class:`~processors.tables.MaskTables`) of the tree :func:`tree_file_bytes` spells,
    built straight from the items: the same states in the same order, the same edges, without writing the tree
    file and parsing it again (``tests/unit/test_catalog_tables.py`` checks both give equal tables).

    The trie is built level by level (:class:`_Trie`: time and memory follow the total number of ids), its nodes
    numbered in preorder. The states are the nodes with a continuation, in that order (the keys of the tree file);
    an edge leads to its child's state, to ``LEAF`` when the child has no continuation, and the end token, where
    the prefix is an item itself, to ``DONE``. Edges are sorted by ``(state, token)`` in one sort."""
    end = catalog.end_token_id
    if len(catalog) == 0:  # the tree file has no keys: no state, the root allows only the end token
        return MaskTables(offsets=np.zeros(1, dtype=np.int64), tokens=np.zeros(0, dtype=np.int32),
                          next_state=np.zeros(0, dtype=np.int32), root=LEAF, end_token_id=end,
                          vocab_size=int(vocab_size))
    if int(catalog.lengths.max()) <= _PADDED_WIDTH:  # (identical tables; a few sorts beat a level per id there)
        return _padded_catalog_tables(catalog, vocab_size)
    trie = _Trie(catalog)
    state_of = np.full(trie.n_nodes, LEAF, dtype=np.int64)  # node -> its state (nodes with a continuation), else LEAF
    internal = np.flatnonzero(trie.has_child)
    state_of[internal] = np.arange(internal.size, dtype=np.int64)
    ends_at = internal[trie.is_end[internal]]
    child = np.arange(1, trie.n_nodes)
    edge_state = np.concatenate((state_of[trie.parent[child]], state_of[ends_at]))
    edge_token = np.concatenate((trie.token[child], np.full(ends_at.size, end, dtype=np.int64)))
    edge_next = np.concatenate((state_of[child], np.full(ends_at.size, DONE, dtype=np.int64)))
    del trie
    order = np.argsort(edge_state * np.int64(vocab_size) + edge_token, kind="stable")
    edge_state, edge_token, edge_next = edge_state[order], edge_token[order], edge_next[order]
    offsets = np.zeros(internal.size + 1, dtype=np.int64)
    np.cumsum(np.bincount(edge_state, minlength=internal.size), out=offsets[1:])
    return MaskTables(offsets=offsets, tokens=edge_token.astype(np.int32), next_state=edge_next.astype(np.int32),
                      root=int(state_of[0]), end_token_id=end, vocab_size=int(vocab_size))


def _padded_catalog_tables(catalog: CatalogItems, vocab_size: int) -> MaskTables:
    """:func:`catalog_tables` of a non-empty catalog whose items are all short (``_PADDED_WIDTH``): the items sorted
    as the rows of a padded matrix (a few sort passes, faster there than a level per id); a node is new where a row
    first differs from the row before, numbered row by row: the same preorder numbering as :class:`_Trie`."""
    n = len(catalog)
    end = catalog.end_token_id
    lengths = catalog.lengths
    width = int(lengths.max())
    matrix = np.full((n, width), -1, dtype=np.int32)
    row = np.repeat(np.arange(n), lengths)
    col = np.arange(catalog.flat.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    matrix[row, col] = catalog.flat
    del row, col
    order = _row_order(matrix)
    matrix, lengths = matrix[order], lengths[order]
    differs = np.ones((n, width + 1), dtype=bool)
    if n > 1:
        differs[1:, :width] = matrix[1:] != matrix[:-1]
    first_diff = differs.argmax(axis=1)
    first_diff[0] = 0
    del differs
    depth = np.arange(width + 1)
    exists = depth[None, :] <= lengths[:, None]
    new = exists & (depth[None, :] > first_diff[:, None])
    new[0, :] = exists[0, :]
    del exists
    n_nodes = int(new.sum())
    ids = np.full(new.shape, -1, dtype=np.int64)
    ids[new] = np.arange(n_nodes, dtype=np.int64)
    node = np.maximum.accumulate(ids, axis=0)
    # the edges (i, d) -> (i, d + 1) with token matrix[i, d], once each: where the child is new
    ei, ed = np.nonzero(new[:, 1:])
    parent, token, child = node[ei, ed], matrix[ei, ed].astype(np.int64), ids[ei, ed + 1]
    del ids, ei, ed
    is_end = np.zeros(n_nodes, dtype=bool)
    is_end[node[np.arange(n), lengths]] = True
    del node
    has_child = np.bincount(parent, minlength=n_nodes) > 0
    state_of = np.full(n_nodes, LEAF, dtype=np.int64)  # node -> its state (nodes with a continuation), else LEAF
    internal = np.flatnonzero(has_child)
    state_of[internal] = np.arange(internal.size, dtype=np.int64)
    ends_at = internal[is_end[internal]]
    edge_state = np.concatenate((state_of[parent], state_of[ends_at]))
    edge_token = np.concatenate((token, np.full(ends_at.size, end, dtype=np.int64)))
    edge_next = np.concatenate((state_of[child], np.full(ends_at.size, DONE, dtype=np.int64)))
    order = np.argsort(edge_state * np.int64(vocab_size) + edge_token, kind="stable")
    edge_state, edge_token, edge_next = edge_state[order], edge_token[order], edge_next[order]
    offsets = np.zeros(internal.size + 1, dtype=np.int64)
    np.cumsum(np.bincount(edge_state, minlength=internal.size), out=offsets[1:])
    return MaskTables(offsets=offsets, tokens=edge_token.astype(np.int32), next_state=edge_next.astype(np.int32),
                      root=int(state_of[0]), end_token_id=end, vocab_size=int(vocab_size))


_PADDED_WIDTH = 16  # the longest item for which catalog_tables uses the padded build


def _row_order(matrix: np.ndarray) -> np.ndarray:
    """The order that sorts the rows of ``matrix`` (ids >= 0, -1 pads) lexicographically, as ``np.lexsort`` of its
    columns would, with fewer sort passes: the columns are packed big-endian into as few int64 words as they fit
    (three 16-bit ids a word for a 49,152-token vocabulary) and the words are lexsorted."""
    n, width = matrix.shape
    if width == 0:
        return np.arange(n)
    bits = max(int(matrix.max()) + 1, 1).bit_length()  # the values + 1: 0 for the pad
    per = max(1, 63 // bits)
    words = []
    for lo in range(0, width, per):
        word = np.zeros(n, dtype=np.int64)
        for c in range(lo, min(lo + per, width)):
            word <<= bits
            word |= matrix[:, c].astype(np.int64) + 1
        words.append(word)
    if len(words) == 1:
        return np.argsort(words[0], kind="stable")
    return np.lexsort(words[::-1])


_TEXT_BLOCK = 1 << 17  # states whose key text is assembled at once


class _KeyWriter:
    """Assembles tree-file entries from codes with one gather: codes below ``vocab`` stand for a token's decimal
    digits, the few above it for the literal pieces of an entry."""

    QUOTE, SEP, OPEN, COMMA, CLOSE = range(5)

    def __init__(self, vocab: int):
        self.vocab = vocab
        pieces = [str(i).encode("ascii") for i in range(vocab)] + [b'"', b"_", b'":[', b",", b"]"]
        self.lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
        self.starts = np.concatenate(([0], np.cumsum(self.lengths)[:-1]))
        self.buffer = np.frombuffer(b"".join(pieces), dtype=np.uint8)

    def block(self, root: int, flat: np.ndarray, starts: np.ndarray, depths: np.ndarray, cands: np.ndarray,
              counts: np.ndarray, final: bool) -> bytes:
        v = self.vocab
        # per state: '"' root ('_' t)*depth '":[' c (',' c)* ']' ','
        sizes = 2 + 2 * depths + 1 + (2 * counts - 1) + 2
        base = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        codes = np.empty(int(sizes.sum()), dtype=np.int64)
        codes[base] = v + self.QUOTE
        codes[base + 1] = root
        # the path: '_' and the token, for k < depth
        owner = np.repeat(np.arange(starts.size), depths)
        k = np.arange(owner.size) - np.repeat(np.cumsum(depths) - depths, depths)
        at = base[owner] + 2 + 2 * k
        codes[at] = v + self.SEP
        codes[at + 1] = flat[starts[owner] + k]
        open_at = base + 2 + 2 * depths
        codes[open_at] = v + self.OPEN
        # candidates: c, then ',' c ...
        owner = np.repeat(np.arange(starts.size), counts)
        j = np.arange(owner.size) - np.repeat(np.cumsum(counts) - counts, counts)
        at = open_at[owner] + 1 + 2 * j
        codes[at] = cands
        codes[at[j > 0] - 1] = v + self.COMMA
        close_at = open_at + 2 * counts
        codes[close_at] = v + self.CLOSE
        codes[close_at + 1] = v + self.COMMA
        if final:
            codes = codes[:-1]  # no ',' after the last entry
        lengths = self.lengths[codes]
        out_starts = np.cumsum(lengths) - lengths
        index = np.repeat(self.starts[codes] - out_starts, lengths) + np.arange(int(lengths.sum()))
        return self.buffer[index].tobytes()
