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
from processors.kinds.tree.catalog.parse import parse_catalog
from processors.kinds.tree.patch.items import apply_tree_delta
from processors.kinds.tree.tables.compile import catalog_tables
from processors.kinds.tree.filters.language import FilterLimits
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
        assert resolved.passing(1 << 30) == len(expected), flt
        if not expected:
            continue
        cursor = TreeCursor(tables).bind(request=ItemRequest(base=resolved.view(1 << 30)))
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
        assert resolved.passing(1 << 30) == len(expected), request
        if expected:
            cursor = TreeCursor(tables).bind(request=ItemRequest(base=resolved.view(1 << 30)))
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
        assert _reachable_items(TreeCursor(tables).bind(request=ItemRequest(base=resolved.view(1 << 30))), END) == expected
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


def _sparse_item(rng: random.Random) -> dict | None:
    """Metadata whose fields come and go (a field only some items have, a list field given as a single string or an
    empty list, booleans and strings in one field), so a PATCH can drop a field's last holder or value."""
    if rng.random() < 0.15:
        return None
    obj: dict = {}
    for name, make in (("region", lambda: rng.choice(["eu", "us", "apac"])),
                       ("tags", lambda: rng.choice([[], ["a"], ["a", "b"], "b", ["c"]])),
                       ("flag", lambda: rng.choice([True, False, "maybe"])),
                       ("rare", lambda: rng.choice(["x", "y"])),
                       ("n", lambda: rng.choice([rng.randint(-5, 5), rng.uniform(0, 1)]))):
        if rng.random() < (0.05 if name == "rare" else 0.6):
            obj[name] = make()
    return obj


def _columns(metadata) -> dict:
    out = {}
    for name, col in metadata.columns.items():
        out[name] = (col.kind, col.values, None if col.codes is None else col.codes.tolist(),
                     None if col.offsets is None else col.offsets.tolist(),
                     None if col.numbers is None else [None if x != x else x for x in col.numbers.tolist()],
                     None if col.listed is None else col.listed.tolist())
    return out


@pytest.mark.parametrize("seed", range(40))
def test_a_patch_splices_the_metadata_columns_as_a_full_parse_gives_them(seed):
    """A PATCH's metadata columns are the base's with rows cut and the new ones appended (no parse of every
    item): exactly what parsing every item of the result gives, values and fields no row holds any more dropped."""
    from processors.kinds.tree.filters.metadata import ItemMetadata

    rng = random.Random(seed)
    items: dict[tuple[int, ...], dict | None] = {}
    while len(items) < rng.choice([3, 20, 80]):
        items[tuple(rng.randint(10, 30) for _ in range(rng.randint(1, 3)))] = _sparse_item(rng)
    base = parse_catalog(_ndjson(items), vocab_size=VOCAB)
    base.metadata()  # the base's columns, as the compile of its version leaves them
    for _ in range(3):
        order = sorted(items)
        removed = rng.sample(order, k=rng.randint(0, len(order) // 2))
        kept = [ids for ids in order if ids not in removed]
        updated = rng.sample(kept, k=rng.randint(0, min(5, len(kept))))
        fresh = [ids for ids in {tuple(rng.randint(10, 30) for _ in range(3)) for _ in range(6)} if ids not in items]
        add = [{"ids": list(ids), "metadata": _sparse_item(rng)} for ids in fresh]
        update = [{"ids": list(ids), "metadata": _sparse_item(rng)} for ids in updated]
        try:
            patched, _ = apply_tree_delta(base, add, [list(ids) for ids in removed], vocab_size=VOCAB, update=update)
        except ConstraintError as err:
            # refused (a field of two kinds across the result): a full parse of the same objects refuses too
            objects = {**{k: v for k, v in items.items() if k not in removed},
                       **{tuple(u["ids"]): u["metadata"] for u in update},
                       **{tuple(a["ids"]): a["metadata"] for a in add}}
            with pytest.raises(ConstraintError):
                ItemMetadata.from_objects(list(objects.values()))
            assert "metadata" in err.message
            continue
        assert patched._metadata_splice is not None  # spliced from the base's columns when read, not parsed
        spliced = patched.metadata()
        full = ItemMetadata.from_objects([None if m is None else json.loads(m) for m in patched.meta or []]) \
            if patched.meta is not None else None
        assert full is not None
        assert _columns(spliced) == _columns(full)
        assert spliced.summary() == full.summary()
        for ids, u in ((tuple(u["ids"]), u["metadata"]) for u in update):
            items[ids] = u
        for ids in removed:
            del items[ids]
        items.update({tuple(a["ids"]): a["metadata"] for a in add})
        base = patched


def test_a_patch_whose_metadata_changes_a_fields_kind_is_refused():
    base = parse_catalog(_ndjson({(11,): {"n": 1}, (12,): {"n": 2.5}}), vocab_size=VOCAB)
    base.metadata()
    with pytest.raises(ConstraintError) as err:
        apply_tree_delta(base, [{"ids": [13], "metadata": {"n": "x"}}], [], vocab_size=VOCAB)
    assert err.value.status == 422 and "'n'" in err.value.message
    # once the last numeric holder is gone the field may change kind, as a full upload of the result allows
    only, _ = apply_tree_delta(base, [], [], vocab_size=VOCAB, update=[{"ids": [11], "metadata": {"n": "x"}},
                                                                        {"ids": [12], "metadata": None}])
    assert only.metadata().columns["n"].kind == "categorical"
