"""Item metadata in the catalog format (``{"ids": [...], "metadata": {...}}`` lines) through parse, PATCH (adds with
metadata, removes) and the tree kind's compile: a request's filter resolved on the compiled version lets rows
complete exactly the items whose metadata pass it, checked against a brute-force evaluation of the filter language
(``test_item_filters._passes``) over the items as the test itself keeps them. No model needed."""

from __future__ import annotations

import json
import random

import pytest
from item_checks import filter_passes as _passes
from test_item_filters import _random_filter, _random_item, _reachable_items

from config import ConstraintError
from processors.items import ItemRequest
from processors.kinds.tree.catalog import parse_catalog
from processors.kinds.tree.catalog_delta import apply_tree_delta
from processors.kinds.tree.catalog_tables import catalog_tables
from processors.kinds.tree.filters import FilterLimits
from processors.registry import get as kind_for_type
from processors.tree import TreeCursor

END, START, VOCAB = 2, 5, 1000


def _ndjson(items: dict[tuple[int, ...], dict | None]) -> bytes:
    lines = [json.dumps({"start_token_id": START, "end_token_id": END})]
    for ids, meta in items.items():
        lines.append(json.dumps(list(ids)) if meta is None else json.dumps({"ids": list(ids), "metadata": meta}))
    return ("\n".join(lines) + "\n").encode()


def _compiled(catalog):
    kind = kind_for_type("tree")
    scenario = kind.config_model.model_validate({"type": "tree", "path": "catalog"})
    return kind, kind.compile_prebuilt(scenario, None, (catalog_tables(catalog, VOCAB), START, catalog)).constraint


def _random_items(rng: random.Random, count: int) -> dict[tuple[int, ...], dict | None]:
    out: dict[tuple[int, ...], dict | None] = {}
    while len(out) < count:
        out[tuple(rng.randint(10, 24) for _ in range(rng.randint(1, 3)))] = _random_item(rng)
    return out


def _check_filters(rng, kind, tables, items, tries: int = 6) -> int:
    checked = 0
    for _ in range(tries):
        flt = _random_filter(rng)
        expected = {ids for ids, meta in items.items() if _passes(meta, flt)}
        try:
            resolved = kind.item_filter(tables, flt, FilterLimits())
        except ConstraintError:
            continue  # (a field no item has: refused, as the filter tests check)
        assert resolved.passing == len(expected), flt
        if not expected:
            continue
        cursor = TreeCursor(tables).bind(request=ItemRequest(base=resolved.book))
        assert _reachable_items(cursor, END) == expected, flt
        assert kind.item_filter(tables, flt, FilterLimits()) is resolved  # cached for this version
        checked += 1
    return checked


@pytest.mark.parametrize("seed", range(8))
def test_filters_on_an_uploaded_catalog_and_after_a_patch(seed):
    rng = random.Random(seed)
    items = _random_items(rng, rng.choice([5, 40, 150]))
    catalog = parse_catalog(_ndjson(items), vocab_size=VOCAB)
    again = parse_catalog(catalog.content(), vocab_size=VOCAB, allow_empty=True)  # as read back from the store
    assert again.content() == catalog.content() and again.meta == catalog.meta
    kind, tables = _compiled(again)
    checked = _check_filters(rng, kind, tables, items)

    # a PATCH: some items removed, new ones added with (or without) metadata
    removed = rng.sample(sorted(items), k=max(1, len(items) // 4))
    fresh = {k: v for k, v in _random_items(rng, 20).items() if k not in items}
    add = [list(ids) if meta is None else {"ids": list(ids), "metadata": meta} for ids, meta in fresh.items()]
    patched, report = apply_tree_delta(again, add, [list(ids) for ids in removed], vocab_size=VOCAB)
    assert report.removed == len(removed) and report.added == len(fresh)
    expected_items = {k: v for k, v in items.items() if k not in removed} | fresh
    assert parse_catalog(patched.content(), vocab_size=VOCAB, allow_empty=True).content() == patched.content()
    kind, tables = _compiled(patched)
    checked += _check_filters(rng, kind, tables, expected_items)
    assert checked, "no filter was checked"


def test_metadata_lines_refused_with_the_line_named():
    good = _ndjson({(11,): {"region": "eu"}})
    for line, words in [
        (b'{"ids": [12], "meta": {}}', "unknown keys"),
        (b'{"metadata": {"a": 1}}', "ids is missing"),
        (b'{"ids": [12], "metadata": [1]}', "metadata must be an object"),
        (b'{"ids": [12], "metadata": {"region": 3}}', "region"),  # a field of two kinds
        (b'{"ids": [12], "metadata": {"stock": NaN}}', "stock"),
    ]:
        with pytest.raises(ConstraintError) as err:
            parse_catalog(good + line + b"\n", vocab_size=VOCAB)
        assert err.value.status == 422 and words in err.value.message, (line, err.value.message)


def test_a_catalog_without_metadata_refuses_a_filter():
    catalog = parse_catalog(_ndjson({(11,): None, (12,): None}), vocab_size=VOCAB)
    kind, tables = _compiled(catalog)
    with pytest.raises(ConstraintError) as err:
        kind.item_filter(tables, {"region": "eu"}, FilterLimits())
    assert err.value.status == 422 and err.value.detail["field"] == "filter"


def test_a_scenario_filter_is_narrowed_by_the_request_and_checked_at_compile():
    from config import ScenarioError

    items = {(11,): {"region": "eu", "stock": 1}, (12,): {"region": "us", "stock": 0}, (13,): {"region": "eu", "stock": 0},
             (14, 15): {"region": "eu", "stock": 4}}
    catalog = parse_catalog(_ndjson(items), vocab_size=VOCAB)
    kind = kind_for_type("tree")

    def compiled(default):
        scenario = kind.config_model.model_validate({"type": "tree", "path": "catalog", "filter": default})
        return kind.compile_prebuilt(scenario, None, (catalog_tables(catalog, VOCAB), START, catalog)).constraint

    tables = compiled({"stock": {"$gt": 0}})
    for request, expected in [(None, {(11,), (14, 15)}), ({"region": "eu"}, {(11,), (14, 15)}),
                              ({"stock": {"$lt": 2}}, {(11,)}), ({"region": {"$ne": "eu"}}, set())]:
        resolved = kind.item_filter(tables, request, FilterLimits())
        assert resolved.passing == len(expected), request
        if expected:
            cursor = TreeCursor(tables).bind(request=ItemRequest(base=resolved.book))
            assert _reachable_items(cursor, END) == expected, request
    # a request's bad field is named as the request sent it, not inside the joined filter
    with pytest.raises(ConstraintError) as err:
        kind.item_filter(tables, {"colour": "red"}, FilterLimits())
    assert err.value.detail["field"] == "filter.colour"
    for default, words in [({"weight": {"$gt": 1}}, "weight"), ({"stock": {"$gt": 9}}, "no item")]:
        with pytest.raises(ScenarioError) as bad:
            compiled(default)
        assert bad.value.detail["field"] == "filter" and words in str(bad.value), str(bad.value)
    assert kind.item_filter(compiled(None), None, FilterLimits()) is None  # nothing to resolve


def test_update_replaces_metadata_keeps_the_tables_and_stores_as_a_line_delta():
    from deployments.storage.content import apply_line_delta, line_delta

    items = {(11,): {"region": "eu"}, (12, 13): {"region": "us"}, (14,): None, (15,): {"region": "eu"}}
    base = parse_catalog(_ndjson(items), vocab_size=VOCAB)
    base.content()
    updated, report = apply_tree_delta(base, [{"ids": [16], "metadata": {"region": "us"}}], [[15]], vocab_size=VOCAB,
                                       update=[{"ids": [11], "metadata": {"region": "us"}},
                                               {"ids": [14], "metadata": {"region": "eu"}},
                                               {"ids": [12, 13], "metadata": {"region": "us"}}])  # (unchanged)
    assert (report.added, report.removed, report.updated) == (1, 1, 2)
    now = {(11,): {"region": "us"}, (12, 13): {"region": "us"}, (14,): {"region": "eu"}, (16,): {"region": "us"}}
    kind, tables = _compiled(updated)
    for flt in ({"region": "eu"}, {"region": "us"}):
        resolved = kind.item_filter(tables, flt, FilterLimits())
        expected = {ids for ids, meta in now.items() if _passes(meta, flt)}
        assert _reachable_items(TreeCursor(tables).bind(request=ItemRequest(base=resolved.book)), END) == expected
    # what Redis keeps: the base's content and the line delta rebuild this version's bytes exactly
    cut, appended = updated.line_delta
    assert apply_line_delta(base.content(), line_delta(cut, appended)) == updated.content()
    # an update alone: the same items, so the same tables (structure untouched)
    only, report = apply_tree_delta(base, [], [], vocab_size=VOCAB, update=[{"ids": [14], "metadata": {"x": 1}}])
    assert report.updated == 1 and report.changed and not report.added and not report.removed
    assert catalog_tables(only, VOCAB).version == catalog_tables(base, VOCAB).version
    for bad, words in [([{"ids": [99], "metadata": {}}], "not an item"), ([[11]], "update[0]"),
                       ([{"ids": [11], "metadata": {"region": 3}}], "region")]:
        with pytest.raises(ConstraintError) as err:
            apply_tree_delta(base, [], [], vocab_size=VOCAB, update=bad)
        assert err.value.status == 422 and words in err.value.message, err.value.message
