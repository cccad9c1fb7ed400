"""The direct compile of a catalog (``catalog_tables``: items -> MaskTables) against the reference path it replaces
(the tree file text of ``tree_file_bytes`` -> ``processors.kinds.tree.treefile.load.load_tree`` -> ``build_tree_tables``): equal tables."""

from __future__ import annotations

import random

import numpy as np
import pytest

from processors.kinds.tree.treefile.load import load_tree
from processors.kinds.tree.catalog.catalog import Catalog, catalog_tables, tree_file_bytes
from processors.kinds.tree.catalog.parse import parse_catalog
from processors.tables import DONE, LEAF, build_tree_tables, item_metrics

VOCAB = 49152


def reference_tables(catalog: Catalog, vocab_size: int, tmp_path):
    path = tmp_path / "tree.json"
    path.write_bytes(tree_file_bytes(catalog))
    return build_tree_tables(load_tree(str(path), vocab_size=vocab_size, strict=False), vocab_size)


def assert_equal_tables(direct, ref):
    assert direct.root == ref.root and direct.end_token_id == ref.end_token_id
    assert direct.vocab_size == ref.vocab_size
    np.testing.assert_array_equal(direct.offsets, ref.offsets)
    np.testing.assert_array_equal(direct.tokens, ref.tokens)
    np.testing.assert_array_equal(direct.next_state, ref.next_state)
    assert direct.offsets.dtype == ref.offsets.dtype and direct.tokens.dtype == ref.tokens.dtype
    assert direct.next_state.dtype == ref.next_state.dtype
    assert direct.warnings == ref.warnings
    assert direct.version == ref.version
    for a, b in zip(item_metrics(direct), item_metrics(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_documented_example(tmp_path):
    body = b'{"start_token_id": 225, "end_token_id": 2, "description": "products"}\n[12, 40, 7]\n[12, 41]\n[12]\n'
    catalog = parse_catalog(body, vocab_size=VOCAB)
    direct = catalog_tables(catalog, VOCAB)
    assert_equal_tables(direct, reference_tables(catalog, VOCAB, tmp_path))
    # spelled out: root --12--> s1; s1 allows 2 (the item [12]), 40 -> s2, 41 -> LEAF; s2 allows 7 -> LEAF
    assert direct.root == 0 and direct.n_states == 3
    assert direct.allowed(0).tolist() == [12] and direct.allowed(1).tolist() == [2, 40, 41]
    assert direct.next_state[direct.offsets[1]:direct.offsets[2]].tolist() == [DONE, 2, LEAF]
    assert direct.allowed(2).tolist() == [7] and direct.step(2, 7) == LEAF
    assert item_metrics(direct)[1][0] == 3


def _random_items(rng: random.Random, n: int, max_depth: int, alphabet: list[int]) -> list[tuple[int, ...]]:
    items: set[tuple[int, ...]] = set()
    made: list[tuple[int, ...]] = []
    while len(made) < n:
        if made and rng.random() < 0.6:  # share a prefix with an earlier item (or extend / cut one)
            base = rng.choice(made)
            cut = rng.randint(1, len(base))
            item = base[:cut] + tuple(rng.choice(alphabet) for _ in range(rng.randint(0, max_depth - cut)))
        else:
            item = tuple(rng.choice(alphabet) for _ in range(rng.randint(1, max_depth)))
        if item and item not in items:
            items.add(item)
            made.append(item)
    return made


@pytest.mark.parametrize("seed", range(12))
def test_random_catalogs_compile_to_the_reference_tables(seed, tmp_path):
    rng = random.Random(seed)
    end, start = 2, rng.choice([0, 5, 225, VOCAB - 1])
    alphabet = {  # small alphabets share prefixes and make items prefixes of others; large ids near the vocab end
        0: [7, 8, 9], 1: list(range(3, 40)), 2: [VOCAB - 1, VOCAB - 2, 3, 1, 0],
    }[seed % 3]
    alphabet = [t for t in alphabet if t != end]
    n = rng.choice([1, 2, 5, 60, 400])
    max_depth = rng.choice([1, 2, 4, 9])
    items = _random_items(rng, min(n, len(alphabet) ** max_depth), max_depth, alphabet)
    catalog = Catalog.from_items(start, end, items)
    direct = catalog_tables(catalog, VOCAB)
    assert_equal_tables(direct, reference_tables(catalog, VOCAB, tmp_path))
    assert int(item_metrics(direct)[1][direct.root]) == len(items)


def test_single_item_and_an_end_token_below_other_ids(tmp_path):
    for start, end, items in ((1, 0, [(5,)]), (1, 0, [(5, 6, 7, 8)]), (3, VOCAB - 1, [(4,), (4, 4), (4, 4, 4)]),
                              (9, 30, [(40,), (20,), (31, 29), (29, 31)])):
        catalog = Catalog.from_items(start, end, items)
        assert_equal_tables(catalog_tables(catalog, VOCAB), reference_tables(catalog, VOCAB, tmp_path))


def test_a_large_fixed_depth_catalog(tmp_path):
    """Four-level ids like the PATCH bench's (many shared prefixes, 40,000 items)."""
    rng = np.random.default_rng(0)
    codes = rng.choice(10**6, size=40000, replace=False)
    items = [(100 + int(c) // 1000 % 10, 200 + int(c) // 100 % 10, 300 + int(c) // 10 % 10, 400 + int(c) % 10)
             for c in rng.choice(10**4, size=5000, replace=False)] + [(5, int(c) % 40000 + 1000, 7) for c in codes[:35000]]
    items = list(dict.fromkeys(items))
    catalog = Catalog.from_items(225, 2, items)
    assert_equal_tables(catalog_tables(catalog, VOCAB), reference_tables(catalog, VOCAB, tmp_path))


@pytest.mark.parametrize("high, width", [(1, 5), (3, 1), (VOCAB, 7), (2**31 - 2, 3), (2**40, 2)])
def test_row_order_is_lexsort_of_the_columns(high, width):
    """The packed sort of catalog_tables orders distinct padded rows as np.lexsort of their columns does."""
    from processors.kinds.tree.catalog.catalog import _row_order

    rng = np.random.default_rng(width)
    matrix = rng.integers(0, high + 1, size=(3000, width), dtype=np.int64)
    cut = rng.integers(1, width + 1, size=3000)  # a row's length; -1 pads the rest
    matrix[np.arange(width)[None, :] >= cut[:, None]] = -1
    matrix = np.unique(matrix, axis=0)[rng.permutation(np.unique(matrix, axis=0).shape[0])]
    np.testing.assert_array_equal(_row_order(matrix), np.lexsort(matrix.T[::-1]))
