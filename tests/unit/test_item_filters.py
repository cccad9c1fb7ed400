"""Item metadata and request filters (``processors/kinds/tree/filters/metadata.py``, ``filters.py``): random catalogs'
metadata and random filters against a brute-force evaluation of every item written from the filter language's rules
(not from the code under test), and every refusal a 422 naming the field."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from config import ConstraintError
from processors.kinds.tree.filters.language import FilterLimits, parse_filter
from processors.kinds.tree.filters.metadata import ItemMetadata, MetadataLimits

from item_checks import filter_passes as _passes

REGIONS = ["eu", "us", "apac", "latam"]
TAGS = ["new", "sale", "gift", "eco", "bulk"]


def _random_item(rng: random.Random) -> dict | None:
    if rng.random() < 0.1:
        return None
    obj: dict = {}
    if rng.random() < 0.9:
        obj["region"] = rng.choice(REGIONS)
    if rng.random() < 0.8:
        obj["stock"] = rng.randint(0, 5)
    if rng.random() < 0.8:
        obj["price"] = round(rng.uniform(0, 100), 1)
    if rng.random() < 0.7:
        obj["tags"] = rng.sample(TAGS, rng.randint(0, 3))
    if rng.random() < 0.5:
        obj["active"] = rng.random() < 0.5
    return obj


def _random_condition(rng: random.Random, field: str):
    if field == "region":
        op = rng.choice(["$eq", "$ne", "$in", "$nin", "$contains", "$not_contains", None])
        if op is None:
            return rng.choice(REGIONS + ["mars"])
        return {op: rng.sample(REGIONS + ["mars"], rng.randint(1, 3)) if op in ("$in", "$nin")
                else rng.choice(REGIONS + ["mars"])}
    if field == "tags":
        op = rng.choice(["$eq", "$ne", "$in", "$nin", "$contains", "$not_contains"])
        return {op: rng.sample(TAGS, rng.randint(1, 2)) if op in ("$in", "$nin") else rng.choice(TAGS)}
    if field == "active":
        return rng.choice([True, False, {"$ne": True}, {"$contains": False}, {"$not_contains": True}])
    ops = rng.sample(["$gt", "$gte", "$lt", "$lte", "$eq", "$ne", "$in", "$nin", "$contains", "$not_contains"],
                     rng.randint(1, 2))
    out = {}
    for op in ops:
        if op in ("$in", "$nin"):
            out[op] = [rng.randint(0, 5) for _ in range(rng.randint(1, 3))]
        else:
            out[op] = rng.randint(0, 5) if field == "stock" else round(rng.uniform(0, 100), 1)
    return out


def _random_filter(rng: random.Random, depth: int = 0) -> dict:
    out: dict = {}
    for field in rng.sample(["region", "stock", "price", "tags", "active"], rng.randint(1, 3)):
        out[field] = _random_condition(rng, field)
    if depth < 2 and rng.random() < 0.4:
        out[rng.choice(["$and", "$or"])] = [_random_filter(rng, depth + 1) for _ in range(rng.randint(1, 3))]
    return out


@pytest.mark.parametrize("seed", range(40))
def test_the_mask_is_the_brute_force_evaluation(seed):
    rng = random.Random(seed)
    items = [_random_item(rng) for _ in range(rng.randint(1, 300))]
    metadata = ItemMetadata.from_objects(items)
    for _ in range(10):
        flt = _random_filter(rng)
        try:
            parsed = parse_filter(flt, metadata)
        except ConstraintError as exc:  # a field no item has in this small catalog
            assert "unknown metadata field" in exc.message, exc.message
            continue
        expected = np.array([_passes(item, flt) for item in items])
        assert np.array_equal(parsed.mask(metadata), expected), flt


def test_summary_gives_kinds_counts_and_ranges():
    metadata = ItemMetadata.from_objects([{"region": "eu", "stock": 3, "tags": ["a", "b"]},
                                          {"region": "eu", "stock": 0.5}, None, {"region": "us", "tags": []}])
    summary = metadata.summary()
    assert summary["region"] == {"kind": "categorical", "list": False, "items": 3, "distinct_values": 2,
                                 "values": {"eu": 2, "us": 1}}
    assert summary["stock"] == {"kind": "numeric", "items": 2, "min": 0.5, "max": 3}
    assert summary["tags"]["list"] is True and summary["tags"]["items"] == 1


@pytest.mark.parametrize("flt, field, words", [
    ({"colour": "red"}, "filter.colour", "unknown metadata field 'colour'"),
    ({"region": {"$like": "e%"}}, "filter.region.$like", "unknown operator '$like'"),
    ({"$not": {"region": "eu"}}, "filter.$not", "unknown operator '$not'"),
    ({"region": {"$gt": "eu"}}, "filter.region.$gt", "compares numbers"),
    ({"stock": "many"}, "filter.stock", "numeric"),
    ({"stock": {"$in": ["1"]}}, "filter.stock.$in", "numeric"),
    ({"stock": {"$gt": float("nan")}}, "filter.stock.$gt", "finite"),
    ({"stock": {"$gt": 10 ** 400}}, "filter.stock.$gt", "past the largest float"),
    ({"stock": -10 ** 400}, "filter.stock", "past the largest float"),
    ({"stock": {"$in": [1, 10 ** 400]}}, "filter.stock.$in", "past the largest float"),
    ({"region": {"$contains": ["eu"]}}, "filter.region.$contains", "takes one value"),
    ({"region": {"$not_contains": 3}}, "filter.region.$not_contains", "categorical"),
    ({"region": {"$in": []}}, "filter.region.$in", "non-empty list"),
    ({"region": 3}, "filter.region", "categorical"),
    ({"$or": []}, "filter.$or", "non-empty list"),
    ({}, "filter", "empty filter"),
    ([], "filter", "expected an object"),
])
def test_a_bad_filter_is_a_422_naming_the_field(flt, field, words):
    metadata = ItemMetadata.from_objects([{"region": "eu", "stock": 1}])
    with pytest.raises(ConstraintError) as info:
        parse_filter(flt, metadata)
    assert info.value.status == 422 and info.value.detail["field"] == field and words in info.value.message


def test_contains_is_chromas_name_for_a_list_field_holding_the_value():
    """``$contains`` / ``$not_contains``: the list holds the value / does not; a single value is a list of one (it
    contains what it equals); an item without the field fails ``$contains`` and passes ``$not_contains``."""
    metadata = ItemMetadata.from_objects([{"tags": ["eu", "us"]}, {"tags": "eu"}, {"tags": []}, {"tags": ["us"]},
                                          {"stock": 3}, {"stock": 4}])
    assert parse_filter({"tags": {"$contains": "eu"}}, metadata).mask(metadata).tolist() == [
        True, True, False, False, False, False]
    assert parse_filter({"tags": {"$not_contains": "eu"}}, metadata).mask(metadata).tolist() == [
        False, False, True, True, True, True]
    assert parse_filter({"stock": {"$contains": 3}}, metadata).mask(metadata).tolist() == [
        False, False, False, False, True, False]
    assert parse_filter({"stock": {"$not_contains": 3}}, metadata).mask(metadata).tolist() == [
        True, True, True, True, False, True]


@pytest.mark.parametrize("flt, words", [
    ({"x" * 100_000: "eu"}, "unknown metadata field"),
    ({"region": {"$" + "x" * 100_000: "eu"}}, "unknown operator"),
    ({"$" + "x" * 100_000: []}, "unknown operator"),
    ({"$or": [{"region": "eu"}, {"x" * 100_000: 1}]}, "unknown metadata field"),
])
def test_a_refusal_repeats_a_long_name_bounded(flt, words):
    """A 100 KB field name or operator is named by its first 64 characters and its length, in the message and the
    detail (the refusal stays a few hundred bytes)."""
    metadata = ItemMetadata.from_objects([{"region": "eu", "stock": 1}])
    with pytest.raises(ConstraintError) as info:
        parse_filter(flt, metadata)
    error = info.value
    assert words in error.message and re.search(r"x\.\.\.\(10000[01] characters\)", error.message), error.message
    assert len(error.message) < 600 and len(repr(error.detail)) < 600, (len(error.message), len(repr(error.detail)))
    assert "x" * 63 in error.detail["field"] and "x" * 65 not in error.detail["field"], error.detail


def test_metadata_refuses_a_long_field_name_bounded():
    """A field name past max_name_length (64) is named by its first 64 characters and its length (a 100 KB one is
    past max_item_bytes first, in an item; columns given whole have no such bound)."""
    with pytest.raises(ConstraintError) as info:
        ItemMetadata.from_objects([{"region": "eu"}, {"n" * 3000: 1}])
    assert "item 1: field name" in info.value.message and "n...(3000 characters)" in info.value.message
    assert len(info.value.message) < 400, len(info.value.message)
    with pytest.raises(ConstraintError) as info:
        ItemMetadata.from_columns(1, {"n" * 100_000: [1.0]})
    assert "n...(100000 characters)" in info.value.message and len(info.value.message) < 400, info.value.message[:200]


def test_filter_bounds_come_before_the_work():
    metadata = ItemMetadata.from_objects([{"region": "eu"}])
    deep: dict = {"region": "eu"}
    for _ in range(10_000):
        deep = {"$and": [deep]}
    with pytest.raises(ConstraintError, match="max_filter_depth"):
        parse_filter(deep, metadata)
    with pytest.raises(ConstraintError, match="max_filter_values"):
        parse_filter({"region": {"$in": ["x"] * 5000}}, metadata, FilterLimits(max_values=1024))
    with pytest.raises(ConstraintError, match="max_filter_clauses"):
        parse_filter({"$or": [{"region": "eu"}] * 100}, metadata)
    with pytest.raises(ConstraintError, match="no metadata"):
        parse_filter({"region": "eu"}, ItemMetadata.from_objects([None]))


@pytest.mark.parametrize("objects, words", [
    ([{"a": 1}, {"a": "x"}], "categorical here and numeric"),
    ([{"a": [1]}], "strings only"),
    ([{"a": {"b": 1}}], "got dict"),
    ([{"a": float("inf")}], "finite"),
    ([{"a": 2 ** 60}], "2^53"),
    ([{"$a": 1}], "not starting with '$'"),
    ([{f"f{i}": 1 for i in range(40)}], "max_fields"),
    ([{"a": "x" * 5000}], "max_item_bytes"),
    ([{"a": ["x"] * 100}], "max_list_length"),
    ([{"a": str(i)} for i in range(20)], "max_values_per_field"),
])
def test_bad_metadata_is_a_422_naming_the_limit_or_field(objects, words):
    with pytest.raises(ConstraintError) as info:
        ItemMetadata.from_objects(objects, MetadataLimits(max_values_per_field=10))
    assert info.value.status == 422 and words in info.value.message, info.value.message


# -- what a filter means for the decode step: a boolean per edge ---------------------------------------------------

def _walk_edges(tables, item) -> list[int] | None:
    """The edges an item takes, its terminal last (an end-token edge, a LEAF edge, or n_edges + state), by
    single-state lookups (``MaskTables.edge``), not the vectorized walk under test."""
    state, path = tables.root, []
    for token in item:
        if state < 0:
            return None
        e = tables.edge(state, token)
        if e < 0:
            return None
        path.append(e)
        state = int(tables.next_state[e])
    if state == -1:  # LEAF: the last edge ends the item
        return path
    lo, hi = int(tables.offsets[state]), int(tables.offsets[state + 1])
    if lo == hi:
        return path + [tables.n_edges + state]
    e = tables.edge(state, tables.end_token_id)
    return path + [e] if e >= 0 else None


@pytest.mark.parametrize("seed", range(24))
def test_the_edge_mask_allows_exactly_the_edges_of_passing_items(seed):
    from processors.kinds.tree.catalog.catalog import Catalog
    from processors.kinds.tree.tables.compile import catalog_tables
    from processors.kinds.tree.filters.edges import edge_mask, filter_book, item_terminals

    rng = random.Random(seed)
    end, start, vocab = 2, 5, 1000
    alphabet = [[7, 8, 9], list(range(10, 40)), [3, 4]][seed % 3]
    items: list[tuple[int, ...]] = []
    for _ in range(rng.choice([1, 5, 60, 400])):
        item = tuple(rng.choice(alphabet) for _ in range(rng.randint(1, [1, 3, 6][seed % 3 if seed % 4 else 2])))
        if item not in items:
            items.append(item)
    catalog = Catalog.from_items(start, end, items)
    tables = catalog_tables(catalog, vocab)
    terminals = item_terminals(tables, catalog.flat, catalog.lengths)
    walked = [_walk_edges(tables, item) for item in items]
    assert all(w is not None for w in walked)
    assert terminals.tolist() == [w[-1] for w in walked]
    for _ in range(5):
        passing = np.array([rng.random() < rng.choice([0.0, 0.05, 0.5, 1.0]) for _ in items])
        expected = np.zeros(tables.n_edges + tables.n_states, dtype=bool)
        for w, ok in zip(walked, passing):
            if ok:
                expected[w] = True
        assert np.array_equal(edge_mask(tables, terminals, passing), expected)
        # the same edges from the request's book (what the vector lane and the beam step read)
        assert np.array_equal(filter_book(tables, terminals, passing).edge_ok(tables), expected[:tables.n_edges])
    # an item the tables do not hold has no terminal
    assert item_terminals(tables, np.array([999, 999]), np.array([2])).tolist() == [-1]


def _reachable_items(cursor, end: int, limit: int = 20) -> set[tuple[int, ...]]:
    """Every item a row bound to the request can complete, by walking all its allowed tokens (copies of the
    cursor), not the arrays under test."""
    from processors.masks import ALLOW

    out: set[tuple[int, ...]] = set()

    def walk(c, prefix):
        step = c.step()
        assert step.kind == ALLOW
        for token in step.payload.tolist():
            if token == end:
                out.add(tuple(prefix))
                continue
            nxt = c.copy()
            nxt.advance(token)
            if len(prefix) < limit:
                walk(nxt, prefix + [token])

    walk(cursor, [])
    return out


@pytest.mark.parametrize("seed", range(16))
def test_rows_under_a_filter_complete_exactly_the_items_that_pass(seed):
    from processors.items import ItemRequest
    from processors.kinds.tree.catalog.catalog import Catalog
    from processors.kinds.tree.tables.compile import catalog_tables
    from processors.kinds.tree.filters.edges import filter_book, item_terminals
    from processors.tree import TreeCursor

    rng = random.Random(1000 + seed)
    end, start = 2, 5
    alphabet = [[7, 8, 9], list(range(10, 30)), [3, 4]][seed % 3]
    items: list[tuple[int, ...]] = []
    for _ in range(rng.choice([3, 30, 120])):
        item = tuple(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
        if item not in items:
            items.append(item)
    metadata_objects = [_random_item(rng) for _ in items]
    metadata = ItemMetadata.from_objects(metadata_objects)
    catalog = Catalog.from_items(start, end, items)
    tables = catalog_tables(catalog, 1000)
    terminals = item_terminals(tables, catalog.flat, catalog.lengths)
    for _ in range(4):
        flt = _random_filter(rng)
        try:
            passing = parse_filter(flt, metadata).mask(metadata)
        except ConstraintError:
            continue
        expected = {item for item, ok in zip(items, passing) if ok}
        if not expected:
            continue  # (the service refuses a filter no item passes)
        book = filter_book(tables, terminals, passing)
        cursor = TreeCursor(tables).bind(request=ItemRequest(base=book))
        assert _reachable_items(cursor, end) == expected, flt
        # under a token budget too: the items that fit the budget (the same row without a filter) and pass
        budget = rng.randint(1, 4)
        fits = _reachable_items(TreeCursor(tables).bind(budget=budget), end) & expected
        if fits:
            cursor = TreeCursor(tables).bind(request=ItemRequest(base=book), budget=budget)
            assert _reachable_items(cursor, end) == fits, (flt, budget)


def test_columns_given_whole_filter_as_the_same_objects():
    rng = random.Random(7)
    objects = [{"region": rng.choice(REGIONS), "stock": rng.randint(0, 5)} if rng.random() < 0.9 else {}
               for _ in range(500)]
    regions = list(reversed(REGIONS))  # any order: sorted on the way in
    codes = [regions.index(o["region"]) if "region" in o else -1 for o in objects]
    stock = [o.get("stock", float("nan")) for o in objects]
    whole = ItemMetadata.from_columns(len(objects), {"region": (regions, codes), "stock": stock})
    one_by_one = ItemMetadata.from_objects(objects)
    for _ in range(30):
        flt = {k: v for k, v in _random_filter(rng).items() if k in ("region", "stock")} or {"region": "eu"}
        assert np.array_equal(parse_filter(flt, whole).mask(whole), parse_filter(flt, one_by_one).mask(one_by_one))
    with pytest.raises(ConstraintError, match="codes"):
        ItemMetadata.from_columns(2, {"region": (["eu"], [0, 5])})
