"""Filters resolved lazily over slot-ordered metadata (``processors/kinds/tree/filters/lazy.py`` over ``slots.py``): on random catalogs
and random filters, every state's count of passing items (capped), every edge's answer and every terminal's, as
the decode step reads them, against a brute-force walk of each item's path with the filter language's rules
written apart from the code under test (``tests/item_checks.py:filter_passes``). Small blocks, so the block
summaries prune."""

from __future__ import annotations

import random

import numpy as np
import pytest

from config import ConstraintError
from processors.items import ItemRequest
from processors.kinds.tree.catalog.catalog import Catalog
from processors.kinds.tree.filters.edges import item_terminals
from processors.kinds.tree.filters.language import parse_filter
from processors.kinds.tree.filters.metadata import ItemMetadata
from processors.kinds.tree.filters.lazy import FilterView, LazyFilter
from processors.kinds.tree.filters.slots import SlotIndex
from processors.kinds.tree.tables.compile import catalog_tables
from processors.tables import item_metrics
from processors.tree import TreeCursor

from item_checks import filter_passes
from test_item_filters import _random_filter, _random_item, _reachable_items, _walk_edges

SKUS = [f"sku{i}" for i in range(100)]  # over 64 values: the block keys, not bits
LABELS = [f"l{i}" for i in range(80)]


def _item(rng: random.Random) -> dict | None:
    obj = _random_item(rng)
    if obj is not None and rng.random() < 0.7:
        obj["sku"] = rng.choice(SKUS[:rng.choice([3, 100])])
    if obj is not None and rng.random() < 0.6:
        obj["labels"] = rng.sample(LABELS, rng.randint(0, 4))
    return obj


def _filter(rng: random.Random) -> dict:
    flt = _random_filter(rng)
    if rng.random() < 0.4:
        flt["sku"] = rng.choice([rng.choice(SKUS), {"$in": rng.sample(SKUS, 3)}, {"$ne": rng.choice(SKUS)}])
    if rng.random() < 0.3:
        flt["labels"] = rng.choice([{"$contains": rng.choice(LABELS)}, {"$nin": rng.sample(LABELS, 2)}])
    return flt


def _catalog(rng: random.Random, sorted_items: bool, sizes=(5, 60, 400, 1500)):
    end, start = 2, 5
    alphabet = rng.choice([[7, 8, 9], list(range(10, 40)), [3, 4, 6]])
    items: list[tuple[int, ...]] = []
    for _ in range(rng.choice(sizes)):
        item = tuple(rng.choice(alphabet) for _ in range(rng.randint(1, 5)))
        if item not in items:
            items.append(item)
    if sorted_items:  # metadata correlated with the tree order (the runs of the blocks are then uniform)
        items.sort()
    return Catalog.from_items(start, end, items), items


@pytest.mark.parametrize("seed", range(30))
def test_lazy_counts_edges_and_terminals_are_the_brute_force_ones(seed):
    rng = random.Random(seed)
    catalog, items = _catalog(rng, sorted_items=seed % 2 == 0)
    tables = catalog_tables(catalog, 1000)
    objects = [_item(rng) for _ in items]
    if seed % 2 == 0:  # runs of equal values along the tree order: block summaries prune
        objects.sort(key=lambda o: (o or {}).get("region", ""))
    metadata = ItemMetadata.from_objects(objects)
    terminals = item_terminals(tables, catalog.flat, catalog.lengths)
    index = SlotIndex.build(tables, metadata, terminals, block=rng.choice([1, 4, 16, 1024]))
    walked = [_walk_edges(tables, item) for item in items]
    # the states on each item's path (root included), from single-state lookups
    paths = []
    for w in walked:
        states = [tables.root] + [int(tables.next_state[e]) for e in w if e < tables.n_edges
                                  and tables.next_state[e] >= 0]
        paths.append(states)
    item_count = item_metrics(tables)[1]
    checked = 0
    for _ in range(8):
        flt = _filter(rng)
        try:
            node = parse_filter(flt, index.schema)
        except ConstraintError:
            continue
        ok = [filter_passes(o, flt) for o in objects]
        count = np.zeros(tables.n_states, dtype=np.int64)
        edge_ok = np.zeros(tables.n_edges + tables.n_states, dtype=bool)
        for w, states, good in zip(walked, paths, ok):
            if good:
                count[states] += 1
                edge_ok[w] = True
        # read lazily, and evaluated over every slot at once (the budget of slots read spent at the first scan)
        lazy = LazyFilter(index, tables, node, budget=rng.choice([0, None]))
        reached = sorted({s for p in paths for s in p})
        for cap in (1, 3, 10_000):
            view = FilterView(lazy, cap)
            got = item_count[reached] - view.lookup(np.asarray(reached))
            assert np.array_equal(got, np.minimum(count[reached], cap)), (flt, cap)
        edges = np.arange(tables.n_edges)
        reached_edges = np.flatnonzero(np.isin(np.searchsorted(tables.offsets, edges, side="right") - 1, reached))
        assert np.array_equal(lazy.edges_ok(reached_edges), edge_ok[reached_edges]), flt
        terms = np.asarray([w[-1] for w in walked])
        assert np.array_equal(FilterView(lazy, 1).ends_taken(terms), ~np.asarray(ok, dtype=bool)), flt
        assert all((int(t) in FilterView(lazy, 1).ends) == (not good) for t, good in zip(terms, ok))
        checked += 1
    assert checked


@pytest.mark.parametrize("seed", range(10))
def test_rows_under_a_lazy_filter_complete_exactly_the_items_that_pass(seed):
    rng = random.Random(500 + seed)
    catalog, items = _catalog(rng, sorted_items=bool(seed % 2), sizes=(5, 60, 200))
    tables = catalog_tables(catalog, 1000)
    objects = [_item(rng) for _ in items]
    metadata = ItemMetadata.from_objects(objects)
    index = SlotIndex.build(tables, metadata, item_terminals(tables, catalog.flat, catalog.lengths), block=4)
    for _ in range(4):
        flt = _filter(rng)
        try:
            node = parse_filter(flt, index.schema)
        except ConstraintError:
            continue
        expected = {item for item, o in zip(items, objects) if filter_passes(o, flt)}
        if not expected:
            continue
        view = FilterView(LazyFilter(index, tables, node), cap=2)
        cursor = TreeCursor(tables).bind(request=ItemRequest(base=view))
        assert _reachable_items(cursor, 2) == expected, flt


@pytest.mark.parametrize("seed", range(12))
def test_updates_beside_the_arrays_filter_as_the_updated_catalog(seed):
    """Rounds of metadata updates (each item's metadata replaced whole, fields new to the catalog included)
    applied to the index beside its arrays: every state's count and every terminal as a brute-force walk of the
    updated metadata gives them, round after round (updates merge, the newest wins)."""
    from processors.kinds.tree.filters.index import ItemFilterIndex

    rng = random.Random(900 + seed)
    catalog, items = _catalog(rng, sorted_items=bool(seed % 2), sizes=(60, 400))
    tables = catalog_tables(catalog, 1000)
    objects = [_item(rng) for _ in items]
    catalog_meta = ItemMetadata.from_objects(objects)
    terminals = item_terminals(tables, catalog.flat, catalog.lengths)
    index = ItemFilterIndex(SlotIndex.build(tables, catalog_meta, terminals, block=rng.choice([4, 1024])))
    walked = [_walk_edges(tables, item) for item in items]
    paths = [[tables.root] + [int(tables.next_state[e]) for e in w if e < tables.n_edges and tables.next_state[e] >= 0]
             for w in walked]
    item_count = item_metrics(tables)[1]
    for _ in range(4):
        picked = rng.sample(range(len(items)), max(1, len(items) // 40))
        new = [_item(rng) for _ in picked]
        if rng.random() < 0.5:
            for obj in new:
                if obj is not None:
                    obj["fresh"] = rng.choice(["x", "y"])  # a field no item had
        updated = index.updated(tables, [items[i] for i in picked], new)
        assert updated is not None
        assert updated.digest != index.digest
        index = updated
        for i, obj in zip(picked, new):
            objects[i] = obj
        for _ in range(5):
            flt = _filter(rng)
            if rng.random() < 0.3:
                flt = {"fresh": rng.choice(["x", {"$ne": "y"}])}
            try:
                resolved = index.resolve(tables, flt)
            except ConstraintError:
                continue
            ok = [filter_passes(o, flt) for o in objects]
            count = np.zeros(tables.n_states, dtype=np.int64)
            for states, good in zip(paths, ok):
                if good:
                    count[states] += 1
            reached = sorted({s for p in paths for s in p})
            view = resolved.view(10_000)
            assert np.array_equal(item_count[reached] - view.lookup(np.asarray(reached)), count[reached]), flt
            # the same filter evaluated over every slot at once (its read budget spent): the updates read too
            whole = FilterView(LazyFilter(index.slots, tables, parse_filter(flt, index.schema), budget=0), 10_000)
            assert np.array_equal(item_count[reached] - whole.lookup(np.asarray(reached)), count[reached]), flt
            terms = np.asarray([w[-1] for w in walked])
            assert np.array_equal(view.ends_taken(terms), ~np.asarray(ok, dtype=bool)), flt
    # past an eighth of the items held beside the arrays: built anew by the caller
    assert index.updated(tables, items, [None] * len(items)) is None
