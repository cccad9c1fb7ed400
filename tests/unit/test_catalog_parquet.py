"""Catalogs uploaded as Parquet (``processors/kinds/tree/parquet.py``): a file with an ``ids`` column and metadata
columns spells the same catalog as the NDJSON lines written here for the same items (same canonical content, same
metadata), nulls leave a field out, fixed-size and large lists read alike; every malformed file is a 422 naming what
is wrong (not Parquet, no header, no or a wrong ``ids`` column, a null row, a column of another type, too many rows)."""

from __future__ import annotations

import io
import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from config import ConstraintError
from processors.kinds.tree.catalog_parse import parse_catalog
from processors.kinds.tree.parquet import parquet_catalog

HEADER = {"start_token_id": 5, "end_token_id": 2, "max_new_tokens": 6}
VOCAB = 1000


def _parquet(table: pa.Table, header: dict | None = HEADER) -> bytes:
    if header is not None:
        table = table.replace_schema_metadata({"catalog": json.dumps(header)})
    out = io.BytesIO()
    pq.write_table(table, out)
    return out.getvalue()


def _ndjson(items: list[tuple[list[int], dict]]) -> bytes:
    lines = [json.dumps(HEADER)]
    lines += [json.dumps({"ids": ids, "metadata": meta}) if meta else json.dumps(ids) for ids, meta in items]
    return ("\n".join(lines) + "\n").encode()


@pytest.mark.parametrize("seed", range(5))
def test_a_parquet_catalog_is_the_ndjson_catalog_of_its_rows(seed):
    rng = random.Random(seed)
    seen: set[tuple[int, ...]] = set()
    items = []
    while len(items) < rng.choice([1, 30, 300]):
        ids = [rng.randint(10, 40) for _ in range(rng.randint(1, 4))]
        if tuple(ids) in seen:
            continue
        seen.add(tuple(ids))
        meta = {"region": rng.choice(["eu", "us", None]), "stock": rng.choice([None, rng.randint(-3, 9)]),
                "price": rng.choice([None, rng.uniform(0, 50)]), "fresh": rng.choice([True, False, None]),
                "tags": rng.choice([None, [], ["a"], ["a", "b"]])}
        items.append((ids, meta))
    table = pa.table({"ids": pa.array([ids for ids, _ in items], pa.list_(pa.int32())),
                      **{field: [meta[field] for _, meta in items] for field in ("region", "stock", "price", "fresh")},
                      "tags": pa.array([meta["tags"] for _, meta in items], pa.list_(pa.string()))})
    expected = [(ids, {k: v for k, v in meta.items() if v is not None}) for ids, meta in items]
    from_parquet = parse_catalog(parquet_catalog(_parquet(table), max_items=10_000), vocab_size=VOCAB)
    from_ndjson = parse_catalog(_ndjson(expected), vocab_size=VOCAB)
    assert from_parquet.content() == from_ndjson.content()
    assert from_parquet.meta == from_ndjson.meta
    assert len(from_parquet) == len(items)


def test_fixed_size_and_large_lists_and_sliced_chunks():
    rows = [[11, 12, 13], [11, 12, 14], [15, 16, 17]]
    expected = parse_catalog(_ndjson([(r, {}) for r in rows]), vocab_size=VOCAB).content()
    for typ in (pa.list_(pa.int64(), 3), pa.large_list(pa.int16()), pa.list_(pa.uint32())):
        table = pa.table({"ids": pa.array(rows, typ)})
        assert parse_catalog(parquet_catalog(_parquet(table), max_items=10), vocab_size=VOCAB).content() == expected
    # several row groups (each read as its own chunk)
    out = io.BytesIO()
    table = pa.table({"ids": pa.array(rows, pa.list_(pa.int32()))}).replace_schema_metadata({"catalog": json.dumps(HEADER)})
    pq.write_table(table, out, row_group_size=1)
    assert parse_catalog(parquet_catalog(out.getvalue(), max_items=10), vocab_size=VOCAB).content() == expected


@pytest.mark.parametrize("make, field", [
    (lambda: b"PAR1 not really", "body"),
    (lambda: _parquet(pa.table({"ids": pa.array([[1, 2]], pa.list_(pa.int32()))}), header=None), "parquet.catalog"),
    (lambda: _parquet(pa.table({"ids": pa.array([[1, 2]], pa.list_(pa.int32()))}).replace_schema_metadata(
        {"catalog": "[1]"}), header=None), "parquet.catalog"),
    (lambda: _parquet(pa.table({"item": pa.array([[1, 2]], pa.list_(pa.int32()))})), "parquet.ids"),
    (lambda: _parquet(pa.table({"ids": ["1,2"]})), "parquet.ids"),
    (lambda: _parquet(pa.table({"ids": pa.array([[1, 2], None], pa.list_(pa.int32()))})), "parquet.ids"),
    (lambda: _parquet(pa.table({"ids": pa.array([[1, 2]], pa.list_(pa.int32())),
                                "when": pa.array([1], pa.timestamp("s"))})), "parquet.when"),
    (lambda: _parquet(pa.table({"ids": pa.array([[1, 2]], pa.list_(pa.int64())),
                                "nested": pa.array([[1]], pa.list_(pa.int32()))})), "parquet.nested"),
    (lambda: _parquet(pa.table({"ids": pa.array([[1, -2]], pa.list_(pa.int64()))})), "parquet.ids"),
    (lambda: _parquet(pa.table({"ids": pa.array([[1, 2]], pa.list_(pa.int64())), "x": [float("nan")]})), "parquet"),
])
def test_malformed_files_are_refused_naming_the_problem(make, field):
    with pytest.raises(ConstraintError) as err:
        parquet_catalog(make(), max_items=10)
    assert err.value.status == 422 and err.value.detail["field"] == field, err.value.message


def test_the_row_count_is_checked_before_reading():
    table = pa.table({"ids": pa.array([[i, i + 1] for i in range(1, 30)], pa.list_(pa.int32()))})
    with pytest.raises(ConstraintError) as err:
        parquet_catalog(_parquet(table), max_items=20)
    assert err.value.detail["limit_name"] == "max_tree_keys" and "29 rows" in err.value.message


# -- the array path (no metadata columns): parquet_items reads the ids column straight into the catalog's arrays ---
from processors.kinds.tree.parquet import parquet_items  # noqa: E402


@pytest.mark.parametrize("seed", range(6))
def test_the_array_path_is_the_ndjson_catalog_of_its_rows(seed):
    rng = random.Random(seed)
    rows = list({tuple(rng.randint(3, 60) for _ in range(rng.randint(1, 5))) for _ in range(rng.choice([1, 40, 400]))})
    typ = rng.choice([pa.list_(pa.int32()), pa.large_list(pa.int64()), pa.list_(pa.uint16())])
    data = _parquet(pa.table({"ids": pa.array([list(r) for r in rows], typ)}), header=HEADER)
    got = parquet_items(data, vocab_size=VOCAB, max_items=10_000, max_item_tokens=8)
    want = parse_catalog(_ndjson([(list(r), {}) for r in rows]), vocab_size=VOCAB)
    assert got._content is None  # no text was made to read it
    assert got.content() == want.content() and got.options == want.options
    assert got.items == [tuple(r) for r in rows] and got.meta is None
    assert got._row_keys.tolist() == want._row_keys.tolist()  # the keys a PATCH looks items up by
    assert got.line_ends().tolist() == want.line_ends().tolist()


@pytest.mark.parametrize("rows, field, says", [
    ([[11, 12], [11, 12]], "items", "line 3"),          # an item twice: named by its line, as in NDJSON
    ([[11, 2]], "items", "line 2"),                     # the end token inside an item
    ([[11, VOCAB]], "items", "line 2"),                 # outside the vocabulary
    ([[11], []], "items", "line 3"),                    # the empty item
    ([[11], list(range(3, 13))], "items", "line 3"),    # over max_item_tokens (8)
])
def test_the_array_path_refuses_as_the_ndjson_path_naming_the_line(rows, field, says):
    data = _parquet(pa.table({"ids": pa.array(rows, pa.list_(pa.int64()))}))
    with pytest.raises(ConstraintError) as err:
        parquet_items(data, vocab_size=VOCAB, max_items=10, max_item_tokens=8)
    with pytest.raises(ConstraintError) as text_err:
        parse_catalog(parquet_catalog(data, max_items=10), vocab_size=VOCAB, max_items=10, max_item_tokens=8)
    assert err.value.status == 422 and says in err.value.message, err.value.message
    assert err.value.message == text_err.value.message and err.value.detail == text_err.value.detail


def test_a_file_with_metadata_takes_the_text_path_and_keeps_it():
    table = pa.table({"ids": pa.array([[11, 12], [13]], pa.list_(pa.int32())), "region": ["eu", None]})
    got = parquet_items(_parquet(table), vocab_size=VOCAB, max_items=10)
    assert got.meta is not None and got.content() == parse_catalog(
        _ndjson([([11, 12], {"region": "eu"}), ([13], {})]), vocab_size=VOCAB).content()
