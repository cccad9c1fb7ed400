"""Catalogs uploaded as Parquet (``processors/kinds/tree/catalog/parquet.py``): a file with an ``ids`` column and metadata
columns spells the same catalog as the NDJSON lines written here for the same items (same canonical content, same
metadata), nulls leave a field out, fixed-size and large lists read alike; every malformed file is a 422 naming what
is wrong (not Parquet, no header, no or a wrong ``ids`` column, a null row, a column of another type, too many rows)."""

from __future__ import annotations

import io
import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from config import ConstraintError
from processors.kinds.tree.catalog.parse import parse_catalog
from processors.kinds.tree.catalog.parquet import parquet_catalog

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
from processors.kinds.tree.catalog.parquet import parquet_items  # noqa: E402


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


# -- the header and ids the NDJSON form refuses; the metadata the memory estimate counts --------------------------
from helpers import repeated_strings, resident_growth  # noqa: E402
from processors.kinds.tree.catalog.parquet import parquet_shape, parquet_strings  # noqa: E402

IDS = pa.array([[11, 12], [13]], pa.list_(pa.int32()))


def _with_header(table: pa.Table, raw: str) -> bytes:
    out = io.BytesIO()
    pq.write_table(table.replace_schema_metadata({"catalog": raw}), out)
    return out.getvalue()


def test_a_null_id_inside_a_row_is_a_422_naming_the_row():
    """``[[100, 200], [101, null, 201]]``: the list is there, one id in it is null (read as a number it became
    -2^31, and the compile failed on it)."""
    for typ in (pa.list_(pa.int64()), pa.large_list(pa.int32()), pa.list_(pa.int64(), 3)):
        fixed = pa.types.is_fixed_size_list(typ)
        rows = [[100, 200, 300], [101, None, 201]] if fixed else [[100, 200], [101, None, 201]]
        data = _parquet(pa.table({"ids": pa.array(rows, typ)}))
        for read in (lambda: parquet_items(data, vocab_size=VOCAB, max_items=10),
                     lambda: parquet_catalog(data, max_items=10)):
            with pytest.raises(ConstraintError) as err:
                read()
            assert err.value.status == 422 and err.value.detail == {"field": "parquet.ids", "row": 1}, err.value.message
            assert err.value.message.startswith("parquet.ids: row 1: a null token id"), err.value.message


@pytest.mark.parametrize("raw, field, says", [
    ('{"start_token_id": 5, "end_token_id": 2, "x": ' + "[" * 200_000 + "]" * 200_000 + "}", "parquet.catalog",
     "not JSON"),
    ('{"start_token_id": 5, "end_token_id": 2, "x": NaN}', "parquet.catalog.x", "NaN is not a finite number"),
    ('{"start_token_id": 5, "end_token_id": 2, "x": {"y": 1e999}}', "parquet.catalog.x.y", "overflows to infinity"),
    ('{"start_token_id": 5, "end_token_id": 2, "end_token_id": 3}', "parquet.catalog", 'duplicate key "end_token_id"'),
])
def test_the_header_is_read_by_the_strict_parser_of_the_ndjson_header(raw, field, says):
    """A header nested 200,000 deep, with NaN or 1e999 (500s before) or a key given twice (stored with its last
    value) is a 422 naming ``parquet.catalog``, as the same header line of an NDJSON upload is."""
    data = _with_header(pa.table({"ids": IDS}), raw)
    with pytest.raises(ConstraintError) as err:
        parquet_items(data, vocab_size=VOCAB, max_items=10)
    assert err.value.status == 422 and err.value.detail["field"] == field, err.value.message
    assert err.value.message.startswith(f"{field}: ") and says in err.value.message, err.value.message
    with pytest.raises(ConstraintError) as ndjson:
        parse_catalog((raw + "\n[11, 12]\n[13]\n").encode(), vocab_size=VOCAB)
    assert ndjson.value.status == 422 and ndjson.value.detail["field"].startswith("header"), ndjson.value.message


def test_a_dictionary_value_counts_once_per_row_that_holds_it():
    """200,000 rows whose ``note`` is the same 4,000 bytes: a file of well under 1 MB whose strings decode to
    800 MB. The footer counts them at their size in the file (one dictionary page); :func:`parquet_strings` counts
    them as they decode (each row's), reading the column as a dictionary: its memory does not grow by the 800 MB."""
    rows, value = 200_000, "x" * 4_000
    table = pa.table({"ids": pa.chunked_array([pa.array([[11, 12]] * rows, pa.list_(pa.int32()))]),
                      "note": repeated_strings(rows, value), "stock": pa.array(np.arange(rows) % 10)})
    data = _parquet(table)
    del table
    assert len(data) < 2**20
    shape = parquet_shape(data)
    assert (shape.rows, shape.ids, shape.values, shape.strings) == (rows, 2 * rows, 2 * rows, (1,))
    assert shape.string_bytes < 2**20  # the footer: the dictionary page, once
    decoded, grown = resident_growth(lambda: parquet_strings(data, shape))
    assert decoded.string_bytes == rows * len(value)
    assert decoded.metadata_bytes >= rows * len(json.dumps({"note": value, "stock": 1}, separators=(",", ":")))
    assert grown < rows * len(value) // 4, grown  # (read as a dictionary: a few MB)


def test_the_strings_and_lists_are_counted_as_their_json_and_the_per_item_bound_holds_per_row():
    """``parquet_strings`` counts each row's strings and lists as their JSON text: a row at the per-item metadata
    bound (4,096 bytes as JSON, ``MetadataLimits.max_item_bytes``) passes it and the NDJSON parse; one byte over,
    it is a 422 naming the row and the limit before the file is read, where the parse of the NDJSON it spells
    refuses the same item."""
    from processors.kinds.tree.filters.metadata import MetadataLimits

    limit = MetadataLimits().max_item_bytes
    rng = random.Random(7)
    tags = [rng.choice([None, [], ["a"], ["é", "bb"]]) for _ in range(300)]
    regions = [rng.choice([None, "eu", "ünder"]) for _ in range(300)]
    table = pa.table({"ids": pa.array([[10 + i // 30, 10 + i % 30] for i in range(300)], pa.list_(pa.int32())),
                      "region": regions, "tags": pa.array(tags, pa.list_(pa.string()))})
    data = _parquet(table)
    strings = [len((r or "").encode()) for r in regions] + [len(t.encode()) for tag in tags for t in (tag or [])]
    assert parquet_strings(data, parquet_shape(data)).string_bytes == sum(strings)

    def file(note: str) -> bytes:
        notes = ["n"] * 5
        notes[3] = note
        return _parquet(pa.table({"ids": pa.array([[11 + i] for i in range(5)], pa.list_(pa.int32())),
                                  "note": notes, "tags": pa.array([["a", "bb"]] * 5, pa.list_(pa.string()))}))

    fixed = len(json.dumps({"note": "", "tags": ["a", "bb"]}, separators=(",", ":")))
    at_limit = "é" * ((limit - fixed) // 2) + "x" * ((limit - fixed) % 2)  # (UTF-8 bytes count, as in NDJSON)
    assert len(json.dumps({"note": at_limit, "tags": ["a", "bb"]}, separators=(",", ":"),
                          ensure_ascii=False).encode()) == limit
    data = file(at_limit)
    parquet_strings(data, parquet_shape(data))
    assert parquet_items(data, vocab_size=VOCAB, max_items=10).meta[3] is not None
    data = file(at_limit + "x")
    with pytest.raises(ConstraintError) as err:
        parquet_strings(data, parquet_shape(data))
    assert err.value.status == 422 and err.value.detail == {
        "field": "parquet", "row": 3, "limit_name": "max_item_bytes", "limit": limit}, err.value.message
    assert "row 3:" in err.value.message and f"{limit + 1:,} bytes" in err.value.message, err.value.message
    with pytest.raises(ConstraintError) as ndjson:
        parquet_items(data, vocab_size=VOCAB, max_items=10)
    assert ndjson.value.detail["limit_name"] == "max_item_bytes" and ndjson.value.detail["item"] == 3


def test_a_row_over_the_per_item_bound_is_refused_without_reading_the_strings_per_row():
    """200,000 rows of a short ``note`` and one of 5,000 bytes (over the per-item bound): a 422 naming that row,
    the column read as a dictionary (no 200,000 strings made)."""
    rows, odd = 200_000, 123_456
    table = pa.table({"ids": pa.chunked_array([pa.array([[11, 12]] * rows, pa.list_(pa.int32()))]),
                      "note": repeated_strings(rows, "s" * 1_000, (odd, "y" * 5_000))})
    data = _parquet(table)
    del table
    with pytest.raises(ConstraintError) as err:
        parquet_strings(data, parquet_shape(data))
    assert err.value.status == 422 and err.value.detail["row"] == odd, err.value.message
    assert err.value.detail["limit_name"] == "max_item_bytes", err.value.message
    assert err.value.message.startswith(f"parquet: row {odd}: its metadata is at least 5,011 bytes"), err.value.message
