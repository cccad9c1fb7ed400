"""Overlay versions of a catalog's tables (``processors/kinds/tree/tables/overlay.py``) against an independent full compile of
the same items (``catalog_tables``): from the root, every reachable state of the overlay answers as the full
compile's (allowed tokens in order, targets, item metrics), after any chain of deltas (an overlay of an overlay),
through pickling (what a replica gets), and the fold is the full compile byte for byte."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from processors.kinds.tree.catalog.catalog import Catalog
from processors.kinds.tree.tables.compile import catalog_tables
from processors.kinds.tree.filters.edges import TreeParents
from processors.kinds.tree.tables.overlay import fold, is_overlay, needs_fold, overlay_tables
from processors.kinds.tree.tables.stacked import Stacked
from processors.tables import item_metrics

from helpers import assert_answers_as
from test_tree_delta import assert_same

VOCAB = 64
END = 2


def full(items):
    return catalog_tables(Catalog.from_items(1, END, [list(i) for i in items]), VOCAB)


def step(tables, items: set, add, remove):
    new = overlay_tables(tables, add, remove)
    items = (items - {tuple(r) for r in remove}) | {tuple(a) for a in add}
    ref = full(items)
    if new is None:  # the root stops being a state: the caller patches or compiles in full
        return ref, items
    if new is tables:
        assert ref.version == (fold(tables).version if is_overlay(tables) else tables.version)
        return tables, items
    assert is_overlay(new)
    assert_answers_as(new, ref)
    assert_same(fold(new), items)  # the fold: byte for byte the full compile
    again = pickle.loads(pickle.dumps(new))  # a replica's copy answers the same and patches to the same version
    assert isinstance(again.tokens, Stacked)
    assert_answers_as(again, ref)
    return new, items


token = st.integers(min_value=3, max_value=9)
item = st.lists(token, min_size=1, max_size=5).map(tuple)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=st.sets(item, min_size=1, max_size=40), steps=st.lists(
    st.tuples(st.sets(item, max_size=8), st.integers(0, 10), st.integers(0, 2 ** 30)), min_size=1, max_size=6))
def test_any_chain_of_overlays_answers_as_a_full_compile(base, steps):
    tables, items = full(base), set(base)
    for adds, n_remove, seed in steps:
        rnd = random.Random(seed)
        remove = rnd.sample(sorted(items), min(n_remove, len(items)))
        if rnd.random() < 0.3 and items:  # a whole subtree
            prefix = rnd.choice(sorted(items))[:1]
            remove = sorted({*remove, *(i for i in items if i[: len(prefix)] == prefix)})
        add = [a for a in adds if a not in set(remove)]
        if rnd.random() < 0.2:  # no-ops, and an item removed by an earlier overlay added back
            kept = sorted(items - set(remove))
            add += [rnd.choice(kept)] if kept else []
            remove += [(9, 9, 9, 9, 9, 9)]
        if rnd.random() < 0.2 and base - items:
            add.append(sorted(base - items)[0])
        add = [a for a in dict.fromkeys(add) if a not in set(remove)]
        if len(items | set(add)) == len(set(remove) & items):
            continue
        tables, items = step(tables, items, add, remove)


@pytest.mark.parametrize("seed", range(4))
def test_random_larger_catalogs_a_chain_of_ten(seed):
    rnd = random.Random(seed)
    items = {tuple(rnd.randint(3, 40) for _ in range(rnd.randint(1, 12))) for _ in range(500)}
    tables = full(items)
    for _ in range(10):
        remove = rnd.sample(sorted(items), 25)
        add = [tuple(rnd.randint(3, 63) for _ in range(rnd.randint(1, 10))) for _ in range(25)]
        add += [r[:-1] for r in remove if len(r) > 1][:3]
        add = [a for a in dict.fromkeys(add) if a not in set(remove)]
        tables, items = step(tables, items, add, remove)
    assert is_overlay(tables)


def test_the_same_delta_in_another_order_gives_the_same_version():
    rnd = random.Random(7)
    items = sorted({tuple(rnd.randint(3, 30) for _ in range(4)) for _ in range(300)})
    base = full(items)
    add = [tuple(rnd.randint(31, 60) for _ in range(4)) for _ in range(40)]
    remove = items[:40]
    a = overlay_tables(base, add, remove)
    b = overlay_tables(pickle.loads(pickle.dumps(base)), add[::-1], remove[::-1])
    assert a.version == b.version != base.version
    c = overlay_tables(a, [items[0]], [])
    d = overlay_tables(b, [items[0]], [])
    assert c.version == d.version


def test_fixed_depth_catalog_overlay_stays_small_and_uniform():
    rnd = np.random.default_rng(1)
    ids = np.unique(rnd.integers(3, 60, size=(4000, 4)), axis=0)
    items = {tuple(r) for r in ids.tolist()}
    base = full(items)
    assert item_metrics(base)[2]
    add = [tuple(r) for r in rnd.integers(3, 60, size=(50, 4)).tolist() if tuple(r) not in items]
    remove = sorted(items)[:50]
    over, items = step(base, items, add, remove)
    assert item_metrics(over)[2]  # still uniform
    grown = over.tokens.size - base.tokens.size
    assert 0 < grown < base.tokens.size / 2
    assert not needs_fold(over, share=1.0) and needs_fold(over, share=grown / base.tokens.size / 2)
    # the base's arrays are the overlay's, not copies
    assert over.tokens.head is base.tokens and over.next_state.head is base.next_state


def test_an_overlay_that_removes_a_non_uniform_part_becomes_uniform():
    items = {(4, 5, 6), (4, 7, 8), (9,)}  # (9,) is shorter: the root is not uniform
    tables, items = step(full(items), items, [], [(9,)])
    assert item_metrics(tables)[2]
    tables, items = step(tables, items, [(10,)], [])
    assert not item_metrics(tables)[2]


def test_removing_everything_but_the_empty_item_is_left_to_the_full_path():
    items = {(4,), ()}
    assert overlay_tables(full(items), [], [(4,)]) is None


def test_parents_under_an_overlay_lead_the_live_way():
    rnd = random.Random(3)
    items = {tuple(rnd.randint(3, 20) for _ in range(3)) for _ in range(200)}
    tables = full(items)
    for _ in range(3):
        remove = rnd.sample(sorted(items), 10)
        add = [tuple(rnd.randint(3, 25) for _ in range(3)) for _ in range(10)]
        add = [a for a in dict.fromkeys(add) if a not in set(remove)]
        tables, items = step(tables, items, add, remove)
    parents = TreeParents(tables)
    # from every reachable state, the parent edge leads back to the root along reachable states
    frontier, reach = [tables.root], {tables.root}
    while frontier:
        s = frontier.pop()
        for e in range(int(tables.offsets[s]), int(tables.offsets[s + 1])):
            t = int(tables.next_state[e])
            if t >= 0:
                assert int(parents.parent_edge[t]) == e
                assert int(parents.edge_source[e]) == s
                reach.add(t)
                frontier.append(t)


def test_stacked_reads_as_the_concatenation():
    head = np.arange(10, dtype=np.int32)
    tail = np.arange(100, 105, dtype=np.int32)
    s, whole = Stacked(head, tail), np.concatenate((head, tail))
    assert s.size == len(s) == 15 and s.shape == (15,) and s.dtype == np.int32
    assert s[3] == 3 and s[12] == 102 and s[-1] == 104
    np.testing.assert_array_equal(s[2:5], whole[2:5])
    np.testing.assert_array_equal(s[11:14], whole[11:14])
    np.testing.assert_array_equal(s[8:12], whole[8:12])  # across the seam: a copy
    idx = np.array([0, 14, 9, 10, 3])
    np.testing.assert_array_equal(s[idx], whole[idx])
    np.testing.assert_array_equal(s.take(np.array([-5, 20]), mode="clip"), whole.take(np.array([-5, 20]), mode="clip"))
    np.testing.assert_array_equal(s[whole > 4], whole[whole > 4])
    np.testing.assert_array_equal(np.diff(s), np.diff(whole))
    np.testing.assert_array_equal(s == 3, whole == 3)
    np.testing.assert_array_equal(s + 1, whole + 1)
    assert s.tolist() == whole.tolist() and s.max() == 104 and s.min() == 0
    assert np.asarray(s, dtype=np.int64).dtype == np.int64
    with pytest.raises(IndexError):
        s.take(np.array([15]))
    back = pickle.loads(pickle.dumps(s))
    np.testing.assert_array_equal(np.asarray(back), whole)


def test_an_overlay_travels_without_its_base_and_waits_for_it_where_it_is_not_held():
    from processors.kinds.tree.tables import overlay as overlay_module

    rnd = np.random.default_rng(5)
    items = {tuple(r) for r in rnd.integers(3, 60, size=(3000, 3)).tolist()}
    base = full(items)
    remove = sorted(items)[:1]
    over, items = step(base, items, [(60, 3, 3)], remove)
    data = pickle.dumps(over)
    assert len(data) < len(pickle.dumps(base)) / 5  # the base's arrays stay home
    held = dict(overlay_module._BASES)
    overlay_module._BASES.clear()  # a process that never held the base (a replica started after the PATCH)
    try:
        waiting = pickle.loads(data)
        assert overlay_module.missing_base(waiting) == base.version
        with pytest.raises(ValueError):
            overlay_module.resolve(waiting, full({(4,)}))
        overlay_module.resolve(waiting, pickle.loads(pickle.dumps(base)))
        assert overlay_module.missing_base(waiting) is None
        assert_answers_as(waiting, full(items))
        assert waiting.version == over.version
    finally:
        overlay_module._BASES.update(held)


def test_the_manager_hands_out_the_base_of_a_served_overlay_only():
    from deployments.manager.served import ServedScenarios
    from processors.compile import CompiledScenario

    rnd = np.random.default_rng(9)
    items = {tuple(r) for r in rnd.integers(3, 60, size=(500, 3)).tolist()}
    base = full(items)
    over = overlay_tables(base, [(60, 4, 4)], sorted(items)[:2])
    served = ServedScenarios()

    def compiled(tables):
        return CompiledScenario(kind="tree", constraint=tables, think=None, eos_token_ids=(END,), vocab_size=VOCAB)

    served.install("cat", 1, compiled(base), compiled(base))
    assert served.base_ref(base.version) is None  # a plain version: no replica needs its base apart
    served.install("cat", 2, compiled(over), compiled(over))
    assert served.base_ref(base.version) is base  # (without Ray: the object itself)
    assert served.base_ref("another") is None
    served.remove("cat")
    assert served.base_ref(base.version) is None
