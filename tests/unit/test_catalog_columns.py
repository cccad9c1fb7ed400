"""A catalog with item metadata read by columns (``parse._meta_catalog``: Arrow's JSON reader; ``parquet_items``: a
Parquet file's columns; both through ``columns.arrow_metadata``): the same items, canonical metadata text, stored
bytes and metadata columns as one object per item gives them (``json.loads``, ``canonical_meta``,
``ItemMetadata.from_objects``), on random catalogs of lists, missing fields, booleans, unicode and escaped strings,
integers and floats (integral ones, and magnitudes Arrow writes otherwise than Python); every upload the object read
refuses is refused with the same 422, and the column read defers to it."""

from __future__ import annotations

import io
import json
import random

import numpy as np
import pytest

from config import ConstraintError
from processors.kinds.tree.catalog import parse as parse_module
from processors.kinds.tree.catalog.catalog import _line, _stored
from processors.kinds.tree.catalog.columns import MetaRows
from processors.kinds.tree.catalog.parquet import parquet_catalog, parquet_items
from processors.kinds.tree.catalog.parse import canonical_meta, parse_catalog
from processors.kinds.tree.filters.metadata import ItemMetadata
from processors.kinds.tree.patch.items import apply_tree_delta

END, START, VOCAB = 2, 5, 5000
HEADER = json.dumps({"start_token_id": START, "end_token_id": END})
STRINGS = ["eu", "us", "é", "日本", "a\"b", "back\\slash", "tab\tnew\nline", "\x01ctl", "😀", "", " sp ", "null"]
NUMBERS = [0, 3, -7, 2 ** 53, 3.0, -0.0, 2.5, 0.1, 1e-7, 1.5e-5, 1e-4, 12345678901.0, 1e16, 1e22, 123456.789,
           9999999999.5, -1e10, 4e15]


def _columns(metadata) -> dict:
    out = {}
    for name, col in metadata.columns.items():
        out[name] = (col.kind, col.values, None if col.codes is None else col.codes.tolist(),
                     None if col.offsets is None else col.offsets.tolist(),
                     None if col.numbers is None else [None if x != x else x for x in col.numbers.tolist()],
                     None if col.listed is None else col.listed.tolist(),
                     sorted(col._index.items()))
    return out


def _random_meta(rng: random.Random) -> dict | None:
    if rng.random() < 0.08:
        return None
    obj: dict = {}
    if rng.random() < 0.8:
        obj["category"] = rng.choice(STRINGS)
    if rng.random() < 0.6:
        obj["region"] = rng.sample(STRINGS, rng.randint(0, 4))
    if rng.random() < 0.7:
        obj["stock"] = rng.randint(-5, 10 ** rng.randint(1, 15))
    if rng.random() < 0.7:
        obj["price"] = rng.choice([rng.choice(NUMBERS), round(rng.uniform(0, 100), 2), rng.uniform(-1, 1) * 10.0 **
                                   rng.randint(-9, 20)])
    if rng.random() < 0.4:
        obj["active"] = rng.random() < 0.5
    if rng.random() < 0.1:
        obj["ünï"] = rng.choice(STRINGS)
    return obj


def _random_catalog(rng: random.Random, count: int) -> tuple[bytes, list[tuple[int, ...]], list[dict | None]]:
    items: dict[tuple[int, ...], dict | None] = {}
    while len(items) < count:
        items[tuple(rng.randint(10, VOCAB - 1) for _ in range(rng.randint(1, 5)))] = _random_meta(rng)
    lines = [HEADER]
    for ids, meta in items.items():
        style = rng.random()
        if meta is None and style < 0.5:
            lines.append(json.dumps(list(ids)))
        elif meta is None:
            lines.append(json.dumps({"ids": list(ids)}) if style < 0.75 else json.dumps({"ids": list(ids),
                                                                                         "metadata": {}}))
        else:
            value = {"metadata": meta, "ids": list(ids)} if style < 0.3 else {"ids": list(ids), "metadata": meta}
            compact = (",", ":") if style < 0.6 else None
            lines.append(json.dumps(value, ensure_ascii=style < 0.5, separators=compact))
        if rng.random() < 0.03:
            lines.append("")  # blank lines are skipped
    return ("\n".join(lines) + "\n").encode(), list(items), list(items.values())


def _expected_content(items: list[tuple[int, ...]], metas: list[dict | None]) -> bytes:
    """The stored bytes as one object per item writes them (the header, then ``_stored`` per line)."""
    head = json.dumps({"format": "cs-items", "start_token_id": START, "end_token_id": END}, separators=(",", ":"))
    return head.encode() + b"\n" + b"".join(_stored(_line(ids), canonical_meta(m) if m else None) + b"\n"
                                            for ids, m in zip(items, metas))


def _by_columns(body: bytes, **kw):
    """``parse._meta_catalog`` of a catalog text, the column read only (None: it defers to the object read)."""
    head, rest = body.split(b"\n", 1)
    start, end, options = parse_module._header(head, 1, VOCAB)
    return parse_module._meta_catalog(rest, start, end, options, VOCAB, kw.get("max_items"),
                                      kw.get("allow_empty", False), kw.get("max_item_tokens"))


@pytest.mark.parametrize("seed", range(30))
def test_the_column_read_gives_what_one_object_per_item_gives(seed):
    rng = random.Random(seed)
    body, items, metas = _random_catalog(rng, rng.choice([1, 3, 40, 300]))
    catalog = _by_columns(body)
    assert catalog is not None  # every such catalog is read by columns
    assert catalog.items == items
    wanted = [canonical_meta(m) if m else None for m in metas]
    if any(wanted):
        assert isinstance(catalog.meta, MetaRows) and list(catalog.meta) == wanted
        assert _columns(catalog._metadata) == _columns(ItemMetadata.from_objects(metas))
        assert catalog._metadata.summary() == ItemMetadata.from_objects(metas).summary()
    else:
        assert catalog.meta is None
    assert catalog.content() == _expected_content(items, metas)
    again = parse_catalog(catalog.content(), vocab_size=VOCAB, allow_empty=True)  # the stored bytes, read back
    assert again.content() == catalog.content() and again.meta == catalog.meta
    assert again.metadata_digest() == catalog.metadata_digest()
    assert parse_catalog(body, vocab_size=VOCAB).content() == catalog.content()


def _object_read(monkeypatch, body: bytes, **kw):
    with monkeypatch.context() as patched:
        patched.setattr(parse_module, "_meta_catalog", lambda *args: None)  # the object read alone: the reference
        return parse_catalog(body, vocab_size=VOCAB, **kw)


def _lines(*lines: str) -> bytes:
    return (HEADER + "\n" + "\n".join(lines) + "\n").encode()


REFUSED = [
    ('{"ids":[10],"metadata":{"a":null}}',),
    ('{"ids":[10],"metadata":{"a":NaN}}',),
    ('{"ids":[10],"metadata":{"a":1e400}}',),
    ('{"ids":[10],"metadata":{"a":%d}}' % (2 ** 60),),
    ('{"ids":[10],"metadata":{"a":%d}}' % (2 ** 70),),
    ('{"ids":[10],"metadata":{"a":1}}', '{"ids":[11],"metadata":{"a":"x"}}'),
    ('{"ids":[10],"metadata":{"a":["x",1]}}',),
    ('{"ids":[10],"metadata":{"a":["x",null]}}',),
    ('{"ids":[10],"metadata":{"a":{"b":1}}}',),
    ('{"ids":[10],"metadata":{"a":1},"x":2}',),
    ('{"ids":[10],"metadata":5}',),
    ('{"metadata":{"a":1}}',),
    ('{"ids":[10],"metadata":{"$a":1}}',),
    ('{"ids":[10],"metadata":{"%s":1}}' % ("n" * 65),),
    ('{"ids":[10],"metadata":{"a":"%s"}}' % ("x" * 5000),),
    ('{"ids":[10],"metadata":{"a":%s}}' % json.dumps(["s"] * 65),),
    ('{"ids":[10],"metadata":{"a":1}}', '{"ids":[10],"metadata":{"a":2}}'),
    ('{"ids":[10],"metadata":{"a":1}}', "[10]"),
    ('{"ids":[%d],"metadata":{"a":1}}' % VOCAB,),
    ('{"ids":[10,2],"metadata":{"a":1}}',),
    ('{"ids":[],"metadata":{"a":1}}',),
    ('{"ids":[10.5],"metadata":{"a":1}}',),
    ('{"ids":[10],"metadata":{"a":1}} x',),
    ('{"ids":[10],"metadata":{"a":"\t"}}',),
    ('{"ids":[10],"metadata":{"a":01}}',),
    ('{"ids":[10],"metadata":{"a":1},}',),
    ('{"ids":[1,2,3,4,5,6,7,8,9,11],"metadata":{"a":1}}',),
]


@pytest.mark.parametrize("lines", REFUSED)
def test_what_the_object_read_refuses_the_upload_refuses_alike(monkeypatch, lines):
    body = _lines(*lines)
    with pytest.raises(ConstraintError) as wanted:
        _object_read(monkeypatch, body, max_item_tokens=8)
    assert _by_columns(body, max_item_tokens=8) is None  # deferred: the object read names the problem
    with pytest.raises(ConstraintError) as got:
        parse_catalog(body, vocab_size=VOCAB, max_item_tokens=8)
    assert (got.value.status, got.value.message, got.value.detail) == (
        wanted.value.status, wanted.value.message, wanted.value.detail)


def test_a_lone_surrogate_is_left_to_the_object_read():
    assert _by_columns(_lines('{"ids":[10],"metadata":{"a":"\\ud800"}}')) is None


@pytest.mark.parametrize("lines", [
    ('{"ids":[10],"metadata":{"a":true}}', '{"ids":[11],"metadata":{"a":"x"}}'),  # booleans and strings: one kind
    ('{"ids":[10],"metadata":{"a":"x"}}', '{"ids":[11],"metadata":{"a":["x","y"]}}'),  # a value and a list
    ('{"ids":[10],"metadata":{"a":1,"a":2}}',),  # a repeated key: the last
    ('{"ids":[10],"metadata":{"a":"nullable"}}',),  # "null" in a string
    ('{"ids":[10],"metadata":{"a":"\\ud83d\\ude00"}}',),  # a surrogate pair
    (' {"ids":[10],"metadata":{"a":1}}',),
])
def test_uploads_the_column_read_leaves_to_the_object_read_are_read_alike(monkeypatch, lines):
    body = _lines(*lines)
    wanted = _object_read(monkeypatch, body)
    got = parse_catalog(body, vocab_size=VOCAB)
    assert got.content() == wanted.content() and got.meta == wanted.meta
    assert _columns(got.metadata()) == _columns(wanted.metadata())


def test_too_many_items_is_refused_before_the_read(monkeypatch):
    body = _lines(*('{"ids":[%d],"metadata":{"a":1}}' % i for i in range(10, 20)))
    with pytest.raises(ConstraintError) as wanted:
        _object_read(monkeypatch, body, max_items=5)
    with pytest.raises(ConstraintError) as got:
        _by_columns(body, max_items=5)
    assert got.value.message == wanted.value.message and "max_tree_keys" in got.value.message


@pytest.mark.parametrize("seed", range(12))
def test_a_patch_of_a_catalog_read_by_columns_is_the_patch_of_one_read_by_objects(monkeypatch, seed):
    rng = random.Random(seed)
    body, items, metas = _random_catalog(rng, 60)
    by_columns, by_objects = parse_catalog(body, vocab_size=VOCAB), _object_read(monkeypatch, body)
    fresh = [ids for ids in {tuple(rng.randint(10, VOCAB - 1) for _ in range(3)) for _ in range(10)} if ids not in items]
    add = [{"ids": list(ids), "metadata": _random_meta(rng) or {}} for ids in fresh]
    remove = [list(ids) for ids in rng.sample(items, 12)]
    kept = [ids for ids in items if list(ids) not in remove]
    update = [{"ids": list(ids), "metadata": _random_meta(rng) or {}} for ids in rng.sample(kept, 5)]
    results = [apply_tree_delta(c, add, remove, vocab_size=VOCAB, update=update)[0] for c in (by_columns, by_objects)]
    assert results[0].content() == results[1].content() and results[0].meta == results[1].meta
    assert results[0].metadata_digest() == results[1].metadata_digest()
    assert _columns(results[0].metadata()) == _columns(results[1].metadata())
    assert results[0].line_delta == results[1].line_delta


def test_meta_rows_read_like_the_list_they_hold():
    rng = random.Random(3)
    metas = [None if rng.random() < 0.3 else canonical_meta(_random_meta(rng) or {"a": 1}) for _ in range(200)]
    rows = MetaRows.from_list(metas)
    assert list(rows) == metas and rows == metas and len(rows) == 200
    assert [rows[i] for i in range(-200, 200)] == metas + metas and rows[5:9] == metas[5:9]
    assert rows.present().tolist() == [m is not None for m in metas]
    assert rows.arrow().to_pylist() == metas
    cut = sorted(rng.sample(range(200), 40))
    added = [None, b'{"x":1}', None]
    assert list(rows.spliced(cut, added)) == [m for i, m in enumerate(metas) if i not in set(cut)] + added
    assert list(MetaRows.none(3)) == [None] * 3


# -- Parquet --------------------------------------------------------------------------------------------------------


def _parquet(rng: random.Random, rows: int) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = list({tuple(rng.randint(10, VOCAB - 1) for _ in range(rng.randint(1, 4))) for _ in range(rows)})
    n = len(ids)

    def maybe(make):
        return [make() if rng.random() < 0.8 else None for _ in range(n)]

    table = pa.table({
        "ids": pa.array([list(i) for i in ids], pa.list_(pa.int32())),
        "category": pa.array(maybe(lambda: rng.choice(STRINGS)), pa.string()),
        "region": pa.array(maybe(lambda: rng.sample(STRINGS, rng.randint(0, 4))), pa.list_(pa.string())),
        "stock": pa.array(maybe(lambda: rng.randint(-5, 10 ** 12)), pa.int64()),
        "price": pa.array(maybe(lambda: rng.choice([rng.choice(NUMBERS) * 1.0, rng.uniform(0, 1e12)])),
                          pa.float64()),
        "weight": pa.array(maybe(lambda: rng.uniform(0, 10)), pa.float32()),
        "active": pa.array(maybe(lambda: rng.random() < 0.5), pa.bool_()),
        "unused": pa.array([None] * n, pa.null()),
    })
    table = table.replace_schema_metadata({"catalog": HEADER})
    out = io.BytesIO()
    pq.write_table(table, out)
    return out.getvalue()


@pytest.mark.parametrize("seed", range(10))
def test_a_parquet_catalog_with_metadata_is_read_by_its_columns_as_its_text_is_read(seed):
    rng = random.Random(seed)
    data = _parquet(rng, rng.choice([1, 20, 400]))
    got = parquet_items(data, vocab_size=VOCAB, max_items=10 ** 6)
    assert got._content is None  # read by its columns: no catalog text made on the way
    wanted = parse_catalog(parquet_catalog(data, max_items=10 ** 6), vocab_size=VOCAB)  # the text the file spells
    assert got.content() == wanted.content() and got.meta == wanted.meta
    assert _columns(got.metadata()) == _columns(wanted.metadata())


def test_a_parquet_value_the_rules_refuse_is_refused_as_its_text_is():
    import pyarrow as pa
    import pyarrow.parquet as pq

    for column in (pa.array([1.5, float("nan")]), pa.array([1, 2 ** 60]), pa.array([["a"], ["b", None]]),
                   pa.array([2 ** 64 - 1, 1], pa.uint64())):
        table = pa.table({"ids": pa.array([[10], [11]]), "a": column}).replace_schema_metadata({"catalog": HEADER})
        out = io.BytesIO()
        pq.write_table(table, out)
        with pytest.raises(ConstraintError) as got:
            parquet_items(out.getvalue(), vocab_size=VOCAB, max_items=10)
        with pytest.raises(ConstraintError) as wanted:
            parse_catalog(parquet_catalog(out.getvalue(), max_items=10), vocab_size=VOCAB)
        assert got.value.message == wanted.value.message


def test_float_text_at_every_magnitude_is_pythons():
    """Each float as ``repr`` writes it, integral ones too, at magnitudes from 1e-12 to 1e20."""
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.random(300) * 10.0 ** rng.integers(-12, 20, 300), np.floor(rng.random(50) * 1e6),
                             np.array([0.0, -0.0, 1e-4, 1e10, 9999999999.999998, 1e16, 2.0 ** 53])])
    lines = [json.dumps({"ids": [10 + i], "metadata": {"x": float(v)}}) for i, v in enumerate(values.tolist())]
    catalog = _by_columns(_lines(*lines))
    assert catalog is not None
    assert list(catalog.meta) == [canonical_meta({"x": float(v)}) for v in values.tolist()]
