"""The catalog tables built without the padded matrix against a copy of the functions they
replaced (the padded-matrix build of ``processors/kinds/tree/catalog_tables.py`` as of commit a5e49c3, kept below as the
reference, unchanged but for its names): the same tables array for array and the same tree file bytes, on varied
catalogs (random catalogs of mixed lengths, shared prefixes, an item that is a prefix of another, one very long
item, the empty item, ids up to the vocabulary's end, the end token's handling)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from processors.kinds.tree.catalog.catalog import Catalog
from processors.kinds.tree.tables.compile import catalog_tables
from processors.kinds.tree.tables.trie import CatalogItems, tree_file_bytes
import processors.kinds.tree.tables.trie as catalog_tables_module
from processors.tables import DONE, LEAF, MaskTables

VOCAB = 49152


# ------------------------------------------------------------------------------------------ the reference (old code)
# fmt: off
# ruff: noqa: E501


def old_tree_file_bytes(catalog: CatalogItems) -> bytes:
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
    text = _OldKeyWriter(max(int(matrix.max(initial=0)), catalog.start_token_id, catalog.end_token_id) + 1)
    blocks = [head.encode("ascii")]
    # the text of a block of states at a time (bounded memory): '"root_t1_t2":[c1,c2],'
    slot = np.zeros(n_nodes, dtype=np.int64)
    slot[internal] = np.arange(internal.size)
    n_cands = np.bincount(slot[cand_state], minlength=internal.size)
    cand_offsets = np.concatenate(([0], np.cumsum(n_cands)))
    for lo in range(0, internal.size, _OLD_TEXT_BLOCK):
        states = internal[lo:lo + _OLD_TEXT_BLOCK]
        rows, depths = node_row[states], node_depth[states]
        counts = n_cands[lo:lo + states.size]
        first, last = int(cand_offsets[lo]), int(cand_offsets[lo + states.size])
        blocks.append(text.block(catalog.start_token_id, matrix, rows, depths, cand_code[first:last], counts,
                                 final=lo + _OLD_TEXT_BLOCK >= internal.size))
    blocks.append(b"}}")
    return b"".join(blocks)


def old_catalog_tables(catalog: CatalogItems, vocab_size: int) -> MaskTables:
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
    order = _old_row_order(matrix)
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


def _old_row_order(matrix: np.ndarray) -> np.ndarray:
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


_OLD_TEXT_BLOCK = 1 << 17  # states whose key text is assembled at once


class _OldKeyWriter:
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

# fmt: on


# ------------------------------------------------------------------------------------------ the tests


def _catalog(items, start=225, end=2) -> Catalog:
    return Catalog.from_items(start, end, [tuple(item) for item in items])


def _random_items(rng: random.Random, n: int, max_depth: int, alphabet: list[int]) -> list[tuple[int, ...]]:
    seen: set[tuple[int, ...]] = set()
    made: list[tuple[int, ...]] = []
    for _ in range(20 * n):  # (a small alphabet and depth have fewer than n distinct items)
        if len(made) == n:
            break
        if made and rng.random() < 0.6:  # share a prefix with an earlier item (cut, extend or both)
            base = rng.choice(made)
            cut = rng.randint(1, len(base))
            item = base[:cut] + tuple(rng.choice(alphabet) for _ in range(rng.randint(0, max(0, max_depth - cut))))
        else:
            item = tuple(rng.choice(alphabet) for _ in range(rng.randint(1, max_depth)))
        if item and item not in seen:
            seen.add(item)
            made.append(item)
    return made


def _cases():
    rng = random.Random(23)
    small = list(range(3, 9))
    yield "documented", [(12, 40, 7), (12, 41), (12,)]
    yield "one item", [(5,)]
    yield "one long item", [tuple(rng.randrange(3, VOCAB) for _ in range(3000))]
    yield "prefix of another", [(5, 6, 7), (5,), (5, 6), (9,), (5, 6, 7, 8, 9)]
    yield "reverse order", [tuple(range(10, 3, -1))[:k] for k in range(7, 0, -1)]
    yield "top ids", [(VOCAB - 1,), (VOCAB - 1, VOCAB - 2), (3, VOCAB - 1), (VOCAB - 2,)]
    yield "id 0 and 1", [(0,), (0, 1), (1, 0), (0, 0, 0)]
    yield "many short + one long", [(a, b) for a in range(3, 40) for b in range(3, 40)] + [tuple([7] * 1024)]
    yield "long shared", [tuple([9] * 200) + (t,) for t in range(3, 60)] + [tuple([9] * 100)]
    yield "the empty item", [(), (5,), (5, 6)]  # a stored catalog of a tree whose root allows the end token
    yield "only the empty item", [()]
    for seed in range(12):
        r = random.Random(seed)
        alphabet = small if seed % 3 == 0 else [r.randrange(3, VOCAB) for _ in range(r.randint(2, 50))]
        yield f"random {seed}", _random_items(r, r.randint(1, 400), r.choice([1, 2, 5, 12, 40]), alphabet)
    r = random.Random(99)
    yield "mixed lengths", [tuple(r.randrange(3, 30) for _ in range(r.choice([1, 1, 2, 3, 8, 17, 33, 70])))
                             for _ in range(600)]


CASES = list(_cases())


def assert_same_tables(new: MaskTables, old: MaskTables) -> None:
    assert new.root == old.root and new.end_token_id == old.end_token_id and new.vocab_size == old.vocab_size
    for name in ("offsets", "tokens", "next_state"):
        a, b = getattr(new, name), getattr(old, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert new.version == old.version


@pytest.mark.parametrize("level_build", [True, False], ids=["levels", "short-padded"])
@pytest.mark.parametrize("name, items", CASES, ids=[name for name, _ in CASES])
def test_tables_and_tree_file_equal_the_padded_build(name, items, level_build, monkeypatch):
    """``level_build``: catalog_tables builds every catalog level by level (else the padded build serves the
    catalogs whose items are all short, as in service)."""
    if level_build:
        monkeypatch.setattr(catalog_tables_module, "_PADDED_WIDTH", 0)
    items = list(dict.fromkeys(items))
    for order in (items, items[::-1], sorted(items)):
        for end in (2, 4):  # 4: an id other items use as a token (never inside an item of this catalog)
            kept = [item for item in order if end not in item]
            if not kept:
                continue
            catalog = _catalog(kept, end=end)
            assert_same_tables(catalog_tables(catalog, VOCAB), old_catalog_tables(catalog, VOCAB))
            if kept != [()]:  # the padded build fails on a catalog of only the empty item (no key to write)
                assert tree_file_bytes(catalog) == old_tree_file_bytes(catalog)


def test_the_empty_catalog():
    catalog = _catalog([])
    assert_same_tables(catalog_tables(catalog, VOCAB), old_catalog_tables(catalog, VOCAB))
    assert json.loads(tree_file_bytes(catalog))["prefix_dict"] == {}


def test_the_documented_example_spelled_out():
    tables = catalog_tables(_catalog([(12, 40, 7), (12, 41), (12,)]), VOCAB)
    assert tables.allowed(1).tolist() == [2, 40, 41]
    assert tables.next_state[tables.offsets[1]:tables.offsets[2]].tolist() == [DONE, 2, LEAF]
    text = json.loads(tree_file_bytes(_catalog([(12, 40, 7), (12, 41), (12,)])))
    assert text["prefix_dict"] == {"225": [12], "225_12": [40, 41, 2], "225_12_40": [7]}
