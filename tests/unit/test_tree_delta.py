"""Tables after a delta (``processors/kinds/tree/tables/delta.py:patch_tables``) against an independent full compile of the new
items (``catalog_tables``): the same arrays byte for byte (same ``version``) and the same item metrics, after any
sequence of deltas: random catalogs, removals that empty a whole subtree, adds under new prefixes, items that are
prefixes of other items (an inner state that ends an item), the empty item's neighbours, no-ops."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from processors.kinds.tree.catalog.catalog import Catalog
from processors.kinds.tree.tables.compile import catalog_tables
from processors.tables import _item_metrics, item_metrics
from processors.kinds.tree.tables.delta import max_remaining, patch_tables

VOCAB = 64
END = 2


def full(items) -> object:
    return catalog_tables(Catalog.from_items(1, END, [list(i) for i in items]), VOCAB)


def assert_same(patched, items):
    ref = full(items)
    assert patched.root == ref.root
    for name in ("offsets", "tokens", "next_state"):
        a, b = getattr(patched, name), getattr(ref, name)
        assert a.dtype == b.dtype, name
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert patched.version == ref.version
    got, want = item_metrics(patched), _item_metrics(ref)  # the reference computed in full, not copied
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(max_remaining(patched), max_remaining(ref))


def apply(tables, items: set, add, remove):
    new = patch_tables(tables, add, remove)
    items = (items - {tuple(r) for r in remove}) | {tuple(a) for a in add}
    if new is None:  # the old tables had no state: the caller compiles in full
        new = full(items)
    assert_same(new, items)
    return new, items


token = st.integers(min_value=3, max_value=9)  # few tokens: shared prefixes, items that are prefixes of others
item = st.lists(token, min_size=1, max_size=5).map(tuple)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=st.sets(item, min_size=1, max_size=40), steps=st.lists(
    st.tuples(st.sets(item, max_size=8), st.integers(0, 10), st.integers(0, 2 ** 30)), min_size=1, max_size=5))
def test_any_sequence_of_deltas_equals_a_full_compile(base, steps):
    tables, items = full(base), set(base)
    for adds, n_remove, seed in steps:
        rnd = random.Random(seed)
        remove = rnd.sample(sorted(items), min(n_remove, len(items)))
        if rnd.random() < 0.3 and items:  # a whole subtree: every item under one prefix
            prefix = rnd.choice(sorted(items))[:1]
            remove = sorted({*remove, *(i for i in items if i[: len(prefix)] == prefix)})
        add = [a for a in adds if a not in set(remove)]
        if rnd.random() < 0.2:  # no-ops: an add already there, a remove not there
            kept = sorted(items - set(remove))
            add += [rnd.choice(kept)] if kept else []
            remove += [(9, 9, 9, 9, 9, 9)]
        if len(items | set(add)) == len(set(remove) & items):
            continue  # would leave no item (a PATCH refuses that)
        tables, items = apply(tables, items, add, remove)


@pytest.mark.parametrize("seed", range(6))
def test_random_larger_catalogs_with_long_items_and_new_prefixes(seed):
    rnd = random.Random(seed)
    vocab_lo = 3
    items = {tuple(rnd.randint(vocab_lo, 40) for _ in range(rnd.randint(1, 24))) for _ in range(400)}
    tables = full(items)
    for _ in range(4):
        remove = rnd.sample(sorted(items), 30)
        add = [tuple(rnd.randint(41, 63) for _ in range(rnd.randint(1, 20))) for _ in range(20)]  # new prefixes
        add += [r[:-1] for r in remove if len(r) > 1][:5]  # a removed item's prefix: a state that becomes a leaf
        add = [a for a in dict.fromkeys(add) if a not in set(remove)]
        tables, items = apply(tables, items, add, remove)


def test_removing_the_only_item_under_a_prefix_drops_its_states_and_adding_under_a_leaf_makes_one():
    items = {(5, 6, 7, 8), (5, 6), (9,)}
    tables = full(items)
    tables, items = apply(tables, items, [], [(5, 6, 7, 8)])  # (5, 6) is a leaf again, (5, 6, 7) gone
    tables, items = apply(tables, items, [(9, 4, 4)], [])  # the leaf (9,) becomes a state ending an item
    tables, items = apply(tables, items, [(3,)], [(9,), (9, 4, 4)])  # the subtree of 9 emptied
    tables, items = apply(tables, items, [], [(3,)])
    assert len(items) == 1


def test_the_empty_item_and_no_state_tables():
    tables, items = apply(full({(4,)}), {(4,)}, [()], [])  # the root ends an item and continues
    tables, items = apply(tables, items, [], [(4,)])  # only the empty item: no state (root LEAF)
    assert tables.root < 0
    tables, items = apply(tables, items, [(4, 5)], [()])  # no state before: a full compile (patch gives None)


def test_no_op_delta_gives_the_same_tables():
    tables = full({(4, 5), (6,)})
    assert patch_tables(tables, [(4, 5)], [(7,)]) is tables


def test_unpickled_tables_can_be_patched(tmp_path):
    import pickle

    items = {(4, 5, 6), (4, 7), (8,)}
    tables = pickle.loads(pickle.dumps(full(items)))  # (the helper array does not travel)
    assert "_max_remaining" not in tables.__dict__
    apply(tables, items, [(4, 5, 9)], [(8,)])


def test_a_wide_root_uses_big_token_ids():
    rnd = np.random.default_rng(3)
    items = {tuple(int(t) for t in rnd.integers(3, VOCAB, size=int(rnd.integers(1, 4)))) for _ in range(2000)}
    tables = full(items)
    remove = sorted(items)[::7]
    add = [tuple(int(t) for t in rnd.integers(3, VOCAB, size=5)) for _ in range(100)]
    apply(tables, items, [a for a in add if a not in items], remove)


@pytest.mark.parametrize("seed", range(8))
def test_the_items_read_from_a_trees_tables_are_those_of_the_loaded_tree(seed, tmp_path):
    """processors/kinds/tree/tables/items.py against items_from_tree of the loaded tree file (keys no path reaches, empty lists,
    the end token at the root and inside, candidates given twice or out of order)."""
    import json

    from processors.kinds.tree.treefile.load import load_tree
    from processors.kinds.tree.catalog.catalog import items_from_tree
    from processors.tables import build_tree_tables
    from processors.kinds.tree.tables.items import tree_items

    rnd = random.Random(seed)
    prefix = {}
    for _ in range(60):
        path = [1] + [rnd.randint(3, 9) for _ in range(rnd.randint(0, 4))]
        cands = [rnd.choice([END, 3, 4, 5, 6, 7, 8, 9]) for _ in range(rnd.randint(0, 3))]
        prefix["_".join(map(str, path))] = cands
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"start_token_id": 1, "end_token_id": END, "prefix_dict": prefix}))
    tree = load_tree(str(path), vocab_size=VOCAB)
    flat, lengths = tree_items(build_tree_tables(tree, VOCAB))
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    got = [tuple(flat[s:s + n].tolist()) for s, n in zip(starts.tolist(), lengths.tolist())]
    assert sorted(got) == sorted(items_from_tree(tree)) and len(got) == len(set(got))


def test_a_uniform_catalogs_longest_way_down_is_its_shortest_kept_once():
    """In a fixed-depth catalog max_remaining equals min_remaining: the tables keep one array for both (4 bytes per
    state less on the manager), through a delta that keeps the catalog uniform; a delta that breaks it gives
    max_remaining an array of its own with the full compile's values, and one that restores it shares again."""
    rnd = np.random.default_rng(5)
    items = {tuple(int(t) for t in rnd.integers(3, VOCAB, size=3)) for _ in range(300)}
    tables = full(items)
    min_rem, _, uniform, _ = item_metrics(tables)
    assert uniform and max_remaining(tables) is min_rem
    add = [tuple(int(t) for t in rnd.integers(3, VOCAB, size=3)) for _ in range(5)]
    add = [a for a in add if a not in items]
    remove = sorted(items)[:4]
    tables, items = apply(tables, items, add, remove)
    assert item_metrics(tables)[2] and max_remaining(tables) is item_metrics(tables)[0]
    longer = [(5, 6, 7, 8)]
    tables, items = apply(tables, items, longer, [])
    assert not item_metrics(tables)[2]
    assert not np.shares_memory(max_remaining(tables), item_metrics(tables)[0])
    tables, items = apply(tables, items, [], longer)
    assert item_metrics(tables)[2] and max_remaining(tables) is item_metrics(tables)[0]
