"""The tables of a catalog (a token tree given as its items), built straight from the items with array passes.

A catalog (``deployments/manager/catalog.py``: the items format of ``PUT /admin/scenarios/{name}`` with
``Content-Type: application/x-ndjson``) is a list of items, each the token ids after the root, without the end
token. :func:`catalog_tables` gives the compiled :class:`~processors.tables.MaskTables` of the tree those items
spell; :func:`tree_file_bytes` gives that tree in the tree file format (:mod:`config.tree_file`). Both build the
same trie (items sorted as rows of a padded matrix; a node is new where a row first differs from the row before,
numbered row by row, so a parent comes before its children), so the tables equal those of the tree file once
loaded (``tests/unit/test_catalog_tables.py`` compares both on random catalogs). See docs/design.md section 4.3.

The items come as a :class:`CatalogItems`: any object with ``start_token_id``, ``end_token_id``, ``flat`` (every
item's ids, concatenated) and ``lengths`` (each item's length), and ``len()`` (the item count).
"""

from __future__ import annotations

import json
from typing import Protocol

import numpy as np

from processors.tables import DONE, LEAF, MaskTables

__all__ = ["CatalogItems", "catalog_tables", "tree_file_bytes"]


class CatalogItems(Protocol):
    """The items of a catalog as arrays (``deployments.manager.catalog.Catalog`` is one)."""

    start_token_id: int
    end_token_id: int
    flat: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int: ...


def tree_file_bytes(catalog: CatalogItems) -> bytes:
    """The tree (tree file format) whose paths are the catalog's items: a state per prefix that has a
    continuation, the end token among its candidates when that prefix is an item itself. A prefix without a
    continuation has no key: the tree format then allows only the end token there.

    The trie is built with array passes (items sorted as rows of a padded matrix; a prefix is a new node where
    a row first differs from the one before); only the key texts are made per state, each from its parent's."""
    n = len(catalog)
    lengths = catalog.lengths
    width = int(lengths.max()) if n else 0
    matrix = np.full((n, width), -1, dtype=np.int32)  # ids < 2**31; int32 halves the peak at 10^7 keys
    row = np.repeat(np.arange(n), lengths)
    col = np.arange(catalog.flat.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    matrix[row, col] = catalog.flat
    order = np.lexsort(matrix.T[::-1]) if width else np.arange(n)
    matrix, lengths = matrix[order], lengths[order]
    # first column where a row differs from the row before (rows are distinct; -1 pads shorter rows)
    differs = np.ones((n, width + 1), dtype=bool)
    if n > 1:
        differs[1:, :width] = matrix[1:] != matrix[:-1]
    first_diff = differs.argmax(axis=1)
    first_diff[0] = 0
    # node (i, d): the prefix of length d of row i, for d <= length; new where first_diff[i] < d (or i == 0)
    depth = np.arange(width + 1)
    exists = depth[None, :] <= lengths[:, None]
    new = exists & (depth[None, :] > first_diff[:, None])
    new[0, :] = exists[0, :]
    n_nodes = int(new.sum())
    ids = np.full(new.shape, -1, dtype=np.int32 if n_nodes < 2**31 else np.int64)
    ids[new] = np.arange(n_nodes, dtype=ids.dtype)  # row-major: a parent (i, d - 1) or an earlier row's node has a smaller id
    node = np.maximum.accumulate(ids, axis=0)  # an old node is the one the row before has at that depth
    # edges (i, d) -> (i, d + 1) with token matrix[i, d], once each: where the child (i, d + 1) is new
    ei, ed = np.nonzero(new[:, 1:])
    parent, token = node[ei, ed], matrix[ei, ed]
    is_end = np.zeros(n_nodes, dtype=bool)
    is_end[node[np.arange(n), lengths]] = True
    node_row, node_depth = np.nonzero(new)  # id order
    internal = np.flatnonzero(np.bincount(parent, minlength=n_nodes) > 0)  # states with a continuation: keys
    # candidates of every internal state: its edges' tokens, then the end token where the prefix is an item
    ends_at = internal[is_end[internal]]
    cand_state = np.concatenate((parent, ends_at))
    cand_code = np.concatenate((token, np.full(ends_at.size, catalog.end_token_id, dtype=np.int64)))
    order = np.argsort(cand_state, kind="stable")
    cand_state, cand_code = cand_state[order], cand_code[order]
    head = json.dumps({"start_token_id": catalog.start_token_id, "end_token_id": catalog.end_token_id,
                       "sep": "_"})[:-1] + ',"prefix_dict":{'
    text = _KeyWriter(max(int(matrix.max(initial=0)), catalog.start_token_id, catalog.end_token_id) + 1)
    blocks = [head.encode("ascii")]
    # the text of a block of states at a time (bounded memory): '"root_t1_t2":[c1,c2],'
    slot = np.zeros(n_nodes, dtype=np.int64)
    slot[internal] = np.arange(internal.size)
    n_cands = np.bincount(slot[cand_state], minlength=internal.size)
    cand_offsets = np.concatenate(([0], np.cumsum(n_cands)))
    for lo in range(0, internal.size, _TEXT_BLOCK):
        states = internal[lo:lo + _TEXT_BLOCK]
        rows, depths = node_row[states], node_depth[states]
        counts = n_cands[lo:lo + states.size]
        first, last = int(cand_offsets[lo]), int(cand_offsets[lo + states.size])
        blocks.append(text.block(catalog.start_token_id, matrix, rows, depths, cand_code[first:last], counts,
                                 final=lo + _TEXT_BLOCK >= internal.size))
    blocks.append(b"}}")
    return b"".join(blocks)


def catalog_tables(catalog: CatalogItems, vocab_size: int) -> MaskTables:
    """The compiled tables (:class:`~processors.tables.MaskTables`) of the tree :func:`tree_file_bytes` spells,
    built straight from the items: the same states in the same order, the same edges, without writing the tree
    file and parsing it again (``tests/unit/test_catalog_tables.py`` checks both give equal tables).

    The trie comes from the same array passes as :func:`tree_file_bytes` (items sorted as rows of a padded
    matrix; a node is new where a row first differs from the row before, numbered row by row, so a parent comes
    before its children). The states are the nodes with a continuation, in that order (the keys of the tree file);
    an edge leads to its child's state, to ``LEAF`` when the child has no continuation, and the end token, where
    the prefix is an item itself, to ``DONE``. Edges are sorted by ``(state, token)`` in one sort."""
    n = len(catalog)
    end = catalog.end_token_id
    if n == 0:  # the tree file has no keys: no state, the root allows only the end token
        return MaskTables(offsets=np.zeros(1, dtype=np.int64), tokens=np.zeros(0, dtype=np.int32),
                          next_state=np.zeros(0, dtype=np.int32), root=LEAF, end_token_id=end,
                          vocab_size=int(vocab_size))
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

    def block(self, root: int, matrix: np.ndarray, rows: np.ndarray, depths: np.ndarray, cands: np.ndarray,
              counts: np.ndarray, final: bool) -> bytes:
        v = self.vocab
        # per state: '"' root ('_' t)*depth '":[' c (',' c)* ']' ','
        sizes = 2 + 2 * depths + 1 + (2 * counts - 1) + 2
        base = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        codes = np.empty(int(sizes.sum()), dtype=np.int64)
        codes[base] = v + self.QUOTE
        codes[base + 1] = root
        # the path: '_' and the token, for k < depth
        owner = np.repeat(np.arange(rows.size), depths)
        k = np.arange(owner.size) - np.repeat(np.cumsum(depths) - depths, depths)
        at = base[owner] + 2 + 2 * k
        codes[at] = v + self.SEP
        codes[at + 1] = matrix[rows[owner], k]
        open_at = base + 2 + 2 * depths
        codes[open_at] = v + self.OPEN
        # candidates: c, then ',' c ...
        owner = np.repeat(np.arange(rows.size), counts)
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
