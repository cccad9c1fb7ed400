"""Request filters over a catalog's item metadata, over real HTTP against the shared app (2 model replicas, the real
model): the NDJSON catalog with ``{"ids", "metadata"}`` lines, ``filter`` on ``/v1/generate`` (greedy, sampling with
``n`` and ``distinct``, beams, ``exclude``) and on ``/v1/completions`` (an extra field, as the openai client's
``extra_body`` sends it), a PATCH that adds items with metadata and removes others, and every refusal a 422 naming the
field. Each output is checked against the items whose metadata pass the filter, computed here from the items this
test wrote (``test_item_filters._passes``: the filter language's rules written apart from the code under test)."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
import requests
from helpers import user_messages
from item_checks import filter_passes as _passes

from deployments.examples import chat_root_token_id

pytestmark = pytest.mark.serve

REGIONS = ["eu", "us", "apac"]


def _items() -> dict[tuple[int, ...], dict]:
    """60 two-token items with region, stock and tags (plain words' token ids, so outputs decode readably)."""
    out = {}
    for i, first in enumerate(range(1000, 1010)):
        for j, second in enumerate(range(2000, 2006)):
            k = i * 6 + j
            out[(first, second)] = {"region": REGIONS[k % 3], "stock": k % 7,
                                    "tags": ["sale"] if k % 4 == 0 else ["new", "eco"] if k % 4 == 1 else []}
    return out


def _ndjson(tokenizer, items) -> bytes:
    head = {"start_token_id": chat_root_token_id(tokenizer), "end_token_id": tokenizer.eos_token_id,
            "max_new_tokens": 8}
    lines = [json.dumps(head)] + [json.dumps({"ids": list(ids), "metadata": meta}) for ids, meta in items.items()]
    return ("\n".join(lines) + "\n").encode()


@pytest.fixture(scope="module")
def catalog(serve_app, tokenizer):
    name = f"flt-{uuid.uuid4().hex[:8]}"
    items = _items()
    r = requests.put(f"{serve_app.url}/admin/scenarios/{name}", data=_ndjson(tokenizer, items), timeout=240,
                     headers={**serve_app.admin, "Content-Type": "application/x-ndjson"})
    assert r.status_code == 200, r.text
    return name, items


def _passing(items, flt) -> set[tuple[int, ...]]:
    return {ids for ids, meta in items.items() if _passes(meta, flt)}


def _item_of(out, eos) -> tuple[int, ...]:
    ids = list(out["token_ids"])
    assert out["finish_reason"] == "stop", out
    if ids and ids[-1] == eos:
        ids = ids[:-1]
    return tuple(ids)


FILTERS = [
    {"region": "eu", "stock": {"$gt": 3}},
    {"$or": [{"tags": {"$in": ["sale"]}}, {"stock": {"$lte": 0}}], "region": {"$ne": "us"}},
    {"tags": {"$nin": ["sale", "new"]}, "stock": {"$gte": 2, "$lt": 5}},
    {"tags": {"$contains": "eco"}, "region": {"$not_contains": "apac"}},  # Chroma's names for list fields
]


@pytest.mark.parametrize("flt", FILTERS)
def test_every_output_passes_the_filter(serve_app, tokenizer, catalog, flt):
    name, items = catalog
    passing = _passing(items, flt)
    assert 4 <= len(passing) < len(items)
    eos = tokenizer.eos_token_id
    ask = {"scenario": name, "messages": user_messages("Pick an item."), "filter": flt}
    for extra in ({}, {"n": 4, "temperature": 1.5, "distinct": True, "seed": 3}, {"num_beams": 8, "n": 4}):
        r = serve_app.generate({**ask, **extra})
        assert r.status_code == 200, (extra, r.text)
        got = [_item_of(out, eos) for out in r.json()["outputs"]]
        assert set(got) <= passing, (extra, got)
        if extra:
            assert len(set(got)) == len(got) == 4, (extra, got)
    # exclude narrows a filter further: excluding all but one passing item leaves that one
    keep = sorted(passing)[0]
    r = serve_app.generate({**ask, "exclude": [list(i) for i in sorted(passing)[1:]], "temperature": 1.5, "seed": 1})
    assert r.status_code == 200, r.text
    assert _item_of(r.json()["outputs"][0], eos) == keep


def test_filter_as_an_openai_extra_field(serve_app, tokenizer, catalog, client):
    name, items = catalog
    flt = FILTERS[0]
    texts = {tokenizer.decode(list(ids)) for ids in _passing(items, flt)}
    resp = client.completions.create(model="default", prompt="Item:", max_tokens=8, n=3, temperature=1.5,
                                     extra_body={"scenario": name, "filter": flt, "distinct": True})
    assert len(resp.choices) == 3
    for choice in resp.choices:
        assert choice.text in texts, (choice.text, texts)


def test_a_patch_with_metadata_changes_what_passes(serve_app, tokenizer, catalog):
    name = f"flt-{uuid.uuid4().hex[:8]}"
    items = _items()
    r = requests.put(f"{serve_app.url}/admin/scenarios/{name}", data=_ndjson(tokenizer, items), timeout=240,
                     headers={**serve_app.admin, "Content-Type": "application/x-ndjson"})
    assert r.status_code == 200, r.text
    flt = {"region": "latam"}
    r = serve_app.generate({"scenario": name, "prompt": "Item:", "filter": flt})
    assert r.status_code == 422 and "no item" in r.text, r.text  # no latam item yet
    added = {(1010, 2000): {"region": "latam", "stock": 1}, (1010, 2001): {"region": "latam", "stock": 0}}
    removed = [ids for ids, meta in items.items() if meta["region"] == "eu"][:5]
    r = requests.patch(f"{serve_app.url}/admin/scenarios/{name}", headers=serve_app.admin, timeout=240, json={
        "add": [{"ids": list(ids), "metadata": meta} for ids, meta in added.items()],
        "remove": [list(ids) for ids in removed]})
    assert r.status_code == 200 and r.json()["added"] == 2 and r.json()["removed"] == 5, r.text
    version = r.json()["version"]
    after = {k: v for k, v in items.items() if k not in removed} | added
    eos = tokenizer.eos_token_id
    for flt in ({"region": "latam"}, {"region": "eu"}, {"stock": {"$lt": 1}}):
        r = serve_app.generate({"scenario": name, "prompt": "Item:", "filter": flt, "n": 2, "distinct": True,
                                "temperature": 1.5})
        assert r.status_code == 200, r.text
        assert r.json()["version"] == version
        for out in r.json()["outputs"]:
            assert _item_of(out, eos) in _passing(after, flt), (flt, out)


@pytest.mark.parametrize("flt, field, words", [
    ({"colour": "red"}, "filter.colour", "unknown metadata field"),
    ({"stock": {"$near": 3}}, "filter.stock", "$near"),
    ({"stock": "many"}, "filter.stock", ""),
    ({"region": {"$gt": "eu"}}, "filter.region", ""),
    ({"region": "mars"}, "filter", "no item"),
    ("eu", "filter", ""),
])
def test_bad_filters_are_422_naming_the_field(serve_app, catalog, flt, field, words):
    name, _ = catalog
    r = serve_app.generate({"scenario": name, "prompt": "Item:", "filter": flt})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    named = error.get("field") or error["errors"][0]["field"]  # (a type error of the body: its list of errors)
    assert named.startswith(field) and words in error["message"], error


@pytest.mark.parametrize("flt, field", [
    ('{"stock": {"$gt": 1%s}}', "filter.stock.$gt"),
    ('{"stock": -1%s}', "filter.stock"),
    ('{"stock": {"$in": [1, 1%s]}}', "filter.stock.$in[1]"),
    ('{"$or": [{"region": "eu"}, {"stock": {"$eq": -1%s}}]}', "filter.$or[1].stock.$eq"),
])
def test_an_integer_past_the_largest_float_is_a_422_naming_its_path(serve_app, tokenizer, catalog, flt, field):
    """A 400-digit integer (JSON allows it; no float holds it) as a bound, an $eq value or in an $in, positive or
    negative: a 422 naming its path, as 1e309 is (it was an OverflowError in the replica, a 500); in a stored
    default filter, a 422 naming filter at the PUT, nothing stored."""
    name, items = catalog
    body = '{"scenario": %s, "prompt": "Item:", "filter": %s}' % (json.dumps(name), flt % ("0" * 400))
    r = requests.post(f"{serve_app.url}/v1/generate", data=body, timeout=120,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text[:300]
    error = r.json()["error"]
    assert error["field"] == field and "past the largest float" in error["message"], error
    head = {"start_token_id": chat_root_token_id(tokenizer), "end_token_id": tokenizer.eos_token_id}
    text = json.dumps({**head, "filter": "DEFAULT"}).replace('"DEFAULT"', flt % ("0" * 400))
    lines = [text] + [json.dumps({"ids": list(ids), "metadata": meta}) for ids, meta in list(items.items())[:4]]
    fresh = f"flt-{uuid.uuid4().hex[:8]}"
    r = requests.put(f"{serve_app.url}/admin/scenarios/{fresh}", data="\n".join(lines) + "\n", timeout=240,
                     headers={**serve_app.admin, "Content-Type": "application/x-ndjson"})
    assert r.status_code == 422 and "past the largest float" in r.json()["error"]["message"], r.text[:300]
    assert r.json()["error"]["field"] == "filter", r.text[:300]
    assert requests.get(f"{serve_app.url}/admin/scenarios/{fresh}", headers=serve_app.admin,
                        timeout=30).status_code == 404


def test_filter_refusals_of_counts_and_kinds(serve_app, catalog):
    name, items = catalog
    flt = FILTERS[0]
    r = serve_app.generate({"scenario": name, "prompt": "Item:", "filter": flt, "n": len(_passing(items, flt)) + 1,
                            "distinct": True, "temperature": 1.0})
    assert r.status_code == 422 and r.json()["error"]["field"] == "n", r.text
    serve_app.put("flt-labels", {"type": "labels", "labels": ["yes", "no"]})
    r = serve_app.generate({"scenario": "flt-labels", "prompt": "Yes?", "filter": {"region": "eu"}})
    assert r.status_code == 422 and r.json()["error"]["field"] == "filter", r.text


def test_huge_and_deep_filters_are_refused_before_the_work_while_others_are_served(serve_app, catalog):
    """Filters nested 25 and 100 levels deep and one $in of a million values: 422 naming the limit, answered at
    the ingress; a probe client's small requests are served meanwhile (their latencies printed, not asserted)."""
    name, _ = catalog
    def nested(levels: int) -> str:  # (as text: json.dumps would recurse as deep)
        return '{"$and":[' * levels + '{"region":"eu"}' + "]}" * levels

    wide = json.dumps({"region": {"$in": [f"r{i}" for i in range(1_000_000)]}})
    probe_times: list[float] = []
    probe_codes: list[int] = []
    stop = threading.Event()

    def probe():
        while not stop.is_set():
            t0 = time.monotonic()
            r = serve_app.generate({"scenario": name, "prompt": "Item:", "filter": FILTERS[0]})
            probe_times.append(time.monotonic() - t0)
            probe_codes.append(r.status_code)

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        for body_filter, limit in ((nested(25), "max_filter_depth"), (nested(100), "max_filter_depth"),
                                   (wide, "max_filter_clauses")):
            body = '{"scenario": %s, "prompt": "Item:", "filter": %s}' % (json.dumps(name), body_filter)
            r = requests.post(f"{serve_app.url}/v1/generate", data=body, timeout=120,
                              headers={"Content-Type": "application/json"})
            assert r.status_code == 422 and r.json()["error"].get("limit_name") == limit, r.text[:300]
    finally:
        stop.set()
        thread.join(timeout=180)
    assert probe_codes and set(probe_codes) == {200}, probe_codes
    print(f"probe during huge filters: {len(probe_times)} requests, max {max(probe_times):.3f} s")


def test_a_stored_default_filter_is_narrowed_never_widened(serve_app, tokenizer):
    name = f"flt-{uuid.uuid4().hex[:8]}"
    items = _items()
    default = {"stock": {"$gte": 3}}
    head = {"start_token_id": chat_root_token_id(tokenizer), "end_token_id": tokenizer.eos_token_id,
            "max_new_tokens": 8, "filter": default}
    data = "\n".join([json.dumps(head)] + [json.dumps({"ids": list(k), "metadata": v}) for k, v in items.items()])
    put = lambda body: requests.put(f"{serve_app.url}/admin/scenarios/{name}", data=body.encode(), timeout=240,  # noqa: E731
                                    headers={**serve_app.admin, "Content-Type": "application/x-ndjson"})
    r = put(data + "\n")
    assert r.status_code == 200, r.text
    got = requests.get(f"{serve_app.url}/admin/scenarios/{name}", headers=serve_app.admin, timeout=30).json()
    assert got["scenario"]["filter"] == default
    summary = got["scenario"]["metadata"]
    assert summary["region"]["kind"] == "categorical" and summary["region"]["values"] == {"eu": 20, "us": 20, "apac": 20}
    assert summary["stock"]["kind"] == "numeric" and (summary["stock"]["min"], summary["stock"]["max"]) == (0, 6)
    eos = tokenizer.eos_token_id
    for request_filter in (None, {"region": "us"}, {"stock": {"$lt": 10}}):  # the last would widen: it cannot
        expected = _passing(items, default) & _passing(items, request_filter or {})
        body = {"scenario": name, "prompt": "Item:", "n": 3, "distinct": True, "temperature": 1.5, "seed": 5}
        if request_filter is not None:
            body["filter"] = request_filter
        r = serve_app.generate(body)
        assert r.status_code == 200, r.text
        for out in r.json()["outputs"]:
            assert _item_of(out, eos) in expected, (request_filter, out)
    r = serve_app.generate({"scenario": name, "prompt": "Item:", "filter": {"stock": {"$lt": 3}}})
    assert r.status_code == 422 and "no item" in r.text, r.text  # the request and the default exclude each other
    # a default filter naming a field the catalog lacks: a 422 naming filter, nothing stored
    bad = data.replace('"filter": {"stock"', '"filter": {"weight"', 1)
    r = put(bad + "\n")
    assert r.status_code == 422 and "filter" in r.text and "weight" in r.text, r.text
    assert requests.get(f"{serve_app.url}/admin/scenarios/{name}", headers=serve_app.admin, timeout=30).json()[
        "version"] == 1


def test_metadata_updates_during_a_stream_of_filtered_requests(serve_app, tokenizer):
    """Each PATCH moves items in and out of the EU by updating their metadata while a client keeps asking for EU
    items: every answer holds only items in the EU at the version it reports."""
    name = f"flt-{uuid.uuid4().hex[:8]}"
    items = _items()
    r = requests.put(f"{serve_app.url}/admin/scenarios/{name}", data=_ndjson(tokenizer, items), timeout=240,
                     headers={**serve_app.admin, "Content-Type": "application/x-ndjson"})
    assert r.status_code == 200, r.text
    at_version = {r.json()["version"]: {k: dict(v) for k, v in items.items()}}
    answers: list[tuple[int, list[tuple[int, ...]]]] = []
    failures: list[str] = []
    stop = threading.Event()
    eos = tokenizer.eos_token_id

    def client():
        seed = 0
        while not stop.is_set():
            seed += 1
            r = serve_app.generate({"scenario": name, "prompt": "Item:", "filter": {"region": "eu"}, "n": 2,
                                    "distinct": True, "temperature": 1.5, "seed": seed})
            if r.status_code != 200:
                failures.append(r.text)
                continue
            answers.append((r.json()["version"], [_item_of(out, eos) for out in r.json()["outputs"]]))

    thread = threading.Thread(target=client)
    thread.start()
    try:
        current = {k: dict(v) for k, v in items.items()}
        keys = sorted(items)
        for round_ in range(4):
            moved = keys[round_ * 10:(round_ + 1) * 10]  # ten items a round change region
            update = []
            for ids in moved:
                meta = dict(current[ids], region="us" if current[ids]["region"] == "eu" else "eu")
                current[ids] = meta
                update.append({"ids": list(ids), "metadata": meta})
            r = requests.patch(f"{serve_app.url}/admin/scenarios/{name}", headers=serve_app.admin, timeout=240,
                               json={"update": update})
            assert r.status_code == 200 and r.json()["updated"] == 10 and r.json()["added"] == 0, r.text
            at_version[r.json()["version"]] = {k: dict(v) for k, v in current.items()}
            time.sleep(1.0)
    finally:
        stop.set()
        thread.join(timeout=240)
    assert not failures, failures[:3]
    assert len({v for v, _ in answers}) >= 2, answers  # the stream saw more than one version
    for version, got in answers:
        allowed = _passing(at_version[version], {"region": "eu"})
        assert set(got) <= allowed, (version, got)


def test_a_parquet_catalog_serves_as_its_ndjson(serve_app, tokenizer, catalog):
    """The same items as a Parquet file (an ``ids`` column, metadata columns, the header in the file's metadata): the
    same stored catalog as the NDJSON upload (its GET summary), filtered outputs pass; a broken file is a 422."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    ndjson_name, items = catalog
    head = json.loads(_ndjson(tokenizer, items).split(b"\n", 1)[0])
    table = pa.table({"ids": pa.array([list(ids) for ids in items], pa.list_(pa.int32())),
                      "region": [meta["region"] for meta in items.values()],
                      "stock": [meta["stock"] for meta in items.values()],
                      "tags": pa.array([meta["tags"] for meta in items.values()], pa.list_(pa.string()))})
    out = io.BytesIO()
    pq.write_table(table.replace_schema_metadata({"catalog": json.dumps(head)}), out)
    name = f"flt-{uuid.uuid4().hex[:8]}"
    r = requests.put(f"{serve_app.url}/admin/scenarios/{name}", data=out.getvalue(), timeout=240,
                     headers={**serve_app.admin, "Content-Type": "application/vnd.apache.parquet"})
    assert r.status_code == 200 and r.json()["items"] == len(items), r.text
    mine = requests.get(f"{serve_app.url}/admin/scenarios/{name}", headers=serve_app.admin, timeout=30).json()
    theirs = requests.get(f"{serve_app.url}/admin/scenarios/{ndjson_name}", headers=serve_app.admin, timeout=30).json()
    assert mine["scenario"]["metadata"] == theirs["scenario"]["metadata"]
    assert mine["scenario"]["content_sha256"] == theirs["scenario"]["content_sha256"]  # the very same catalog
    flt = FILTERS[1]
    r = serve_app.generate({"scenario": name, "prompt": "Item:", "filter": flt, "n": 3, "distinct": True,
                            "temperature": 1.5})
    assert r.status_code == 200, r.text
    for out_ in r.json()["outputs"]:
        assert _item_of(out_, tokenizer.eos_token_id) in _passing(items, flt), out_
    r = requests.put(f"{serve_app.url}/admin/scenarios/{name}", data=b"PAR1" + b"\0" * 64, timeout=60,
                     headers={**serve_app.admin, "Content-Type": "application/vnd.apache.parquet"})
    assert r.status_code == 422 and "not a Parquet file" in r.text, r.text
