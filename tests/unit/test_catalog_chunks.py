"""The chunked compile of a large catalog (``catalog_chunks.chunked_tables``: the root's subtrees compiled in chunks of
a few ids, a first token with more ids than a chunk cut again under it) against the whole compile
(``catalog_tables.whole_tables``): the same arrays, version and item metrics, byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from processors.kinds.tree.tables.chunks import chunked_tables
from processors.kinds.tree.tables.trie import whole_tables
from processors.tables import DONE, LEAF, item_metrics

VOCAB = 300
END = 2


class Items:
    def __init__(self, items: list[tuple[int, ...]]):
        self.start_token_id, self.end_token_id = 1, END
        self.lengths = np.array([len(i) for i in items], dtype=np.int32)
        self.flat = np.array([t for i in items for t in i], dtype=np.int32)

    def __len__(self) -> int:
        return int(self.lengths.size)


def assert_same(chunked, whole):
    assert chunked.version == whole.version
    assert chunked.root == whole.root
    for name in ("offsets", "tokens", "next_state"):
        a, b = getattr(chunked, name), getattr(whole, name)
        assert a.dtype == b.dtype, name
        np.testing.assert_array_equal(a, b, err_msg=name)
    got, want = item_metrics(chunked), item_metrics(whole)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert got[0].dtype == want[0].dtype and got[1].dtype == want[1].dtype
    assert got[2:] == want[2:]
    if whole.n_states:
        np.testing.assert_array_equal(chunked.__dict__["_max_remaining"], whole.__dict__["_max_remaining"])
        assert (chunked.__dict__["_max_remaining"] is got[0]) == (whole.__dict__["_max_remaining"] is want[0])
    assert not chunked.tokens.flags.writeable and not got[0].flags.writeable


tokens = st.integers(min_value=3, max_value=12)  # a small alphabet: long shared prefixes, deep single tokens
item_sets = st.sets(st.tuples(tokens) | st.lists(tokens, min_size=0, max_size=6).map(tuple) |
                    st.lists(tokens, min_size=17, max_size=20).map(tuple), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(item_sets, st.integers(min_value=1, max_value=40), st.randoms(use_true_random=False))
def test_chunked_tables_are_the_whole_compile(items, chunk_ids, rnd):
    listed = sorted(items)
    rnd.shuffle(listed)  # upload order is any order
    catalog = Items(listed)
    assert_same(chunked_tables(catalog, VOCAB, chunk_ids=chunk_ids), whole_tables(catalog, VOCAB))


def test_a_fixed_depth_catalog_cut_in_many_chunks_and_one_deep_token():
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 16, size=(20_000, 4)) + np.array([10, 30, 50, 70])
    ids[:8_000, 0] = 10  # one first token holds 40% of the ids: cut again under it
    ids = np.unique(ids, axis=0).astype(np.int32)
    rng.shuffle(ids)
    catalog = Items([tuple(r) for r in ids.tolist()])
    whole = whole_tables(catalog, VOCAB)
    for chunk_ids in (4_000, 10_000, 30_000):
        assert_same(chunked_tables(catalog, VOCAB, chunk_ids=chunk_ids), whole)
    assert whole.__dict__["_max_remaining"] is item_metrics(whole)[0]  # uniform: kept once, chunked too


def test_the_empty_item_and_prefix_items_under_chunks():
    items = [(), (5,), (5, 6), (5, 6, 7), (8,), (9, 3), (9, 4, 4)]
    chunked = chunked_tables(Items(items), VOCAB, chunk_ids=2)
    assert_same(chunked, whole_tables(Items(items), VOCAB))
    assert chunked.allowed(chunked.root).tolist() == [END, 5, 8, 9]
    assert chunked.step(chunked.root, END) == DONE and chunked.step(chunked.root, 8) == LEAF
    assert item_metrics(chunked)[1][chunked.root] == len(items)


@pytest.mark.parametrize("items", [[()], [(4,)], [(4, 5), (4, 6)]])
def test_tiny_catalogs(items):
    assert_same(chunked_tables(Items(items), VOCAB, chunk_ids=1), whole_tables(Items(items), VOCAB))


def test_row_keys_in_blocks_are_the_keys_at_once(monkeypatch):
    from processors.kinds.tree.catalog import lines as item_lines

    rng = np.random.default_rng(3)
    lengths = rng.integers(0, 9, size=5_000).astype(np.int32)
    flat = rng.integers(0, 1000, size=int(lengths.sum())).astype(np.int32)
    whole = item_lines.row_keys(flat, lengths)
    for block in (1, 7, 100, 4096):
        monkeypatch.setattr(item_lines, "_ID_BLOCK", block)
        assert np.array_equal(item_lines.row_keys(flat, lengths), whole)


def test_id_text_in_blocks_is_the_text_at_once(monkeypatch):
    from processors.kinds.tree.catalog import lines as item_lines

    rng = np.random.default_rng(4)
    lengths = rng.integers(1, 9, size=3_000).astype(np.int32)
    flat = rng.integers(0, 100_000, size=int(lengths.sum())).astype(np.int32)
    whole = item_lines.id_text(flat, lengths)
    assert whole.count(b"\n") == lengths.size and whole.startswith(b"[")
    for block in (1, 5, 64, 5_000):
        monkeypatch.setattr(item_lines, "_ID_BLOCK", block)
        assert item_lines.id_text(flat, lengths) == whole
