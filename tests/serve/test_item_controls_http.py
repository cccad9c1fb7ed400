"""Item controls over HTTP through the shared Serve app: exclude and distinct on POST /v1/generate and as extra
body fields of the OpenAI routes, multi-item scenarios, and the 4xx answers."""

from __future__ import annotations

import itertools

import pytest
import requests
from item_checks import product_tree

CODES = [1000 + 7 * i for i in range(5)]
ROOT, SEP = 2000, 2100
CATALOG = [tuple(p) for p in itertools.product(CODES, repeat=2)]  # 25 two-token items


def tree(eos: int) -> dict:
    return product_tree(ROOT, CODES, 2, eos)


@pytest.fixture(scope="module")
def catalog(serve_app, tokenizer):
    eos = tokenizer.eos_token_id
    serve_app.put("t-items", {"type": "tree", "tree": tree(eos)})
    serve_app.put("t-items-multi", {"type": "tree", "tree": tree(eos), "max_items": 3, "separator_token_id": SEP})
    return eos


def test_exclude_and_distinct_over_native_http(serve_app, catalog):
    eos = catalog
    excluded = CATALOG[:17]  # 8 items left, n = 8: distinct must return all of them
    r = serve_app.generate({"scenario": "t-items", "prompt": "Items:", "exclude": [list(i) for i in excluded],
                            "distinct": True, "n": 8, "temperature": 1.5, "max_new_tokens": 4})
    assert r.status_code == 200, r.text
    outs = r.json()["outputs"]
    items = [tuple(o["token_ids"][:-1]) for o in outs]
    assert all(o["finish_reason"] == "stop" and o["token_ids"][-1] == eos for o in outs), outs
    assert set(items) == set(CATALOG[17:]) and len(items) == 8


def test_multi_item_scenario_over_http(serve_app, catalog):
    eos = catalog
    r = serve_app.generate({"scenario": "t-items-multi", "prompt": "Items:", "n": 4, "temperature": 1.5,
                            "exclude": [list(CATALOG[0])], "max_new_tokens": 7})
    assert r.status_code == 200, r.text
    for out in r.json()["outputs"]:
        ids = out["token_ids"][:-1] if out["token_ids"][-1] == eos else out["token_ids"]
        parts = [tuple(p) for p in _split(ids, SEP)]
        assert all(p in CATALOG and p != CATALOG[0] for p in parts) and len(set(parts)) == len(parts) <= 3, out


def _split(ids, sep):
    cur: list[int] = []
    for t in ids:
        if t == sep:
            yield cur
            cur = []
        else:
            cur.append(t)
    yield cur


def test_item_controls_as_openai_extra_body(serve_app, catalog, client):
    resp = client.completions.create(model="default", prompt="Items:", max_tokens=4, n=5, temperature=1.5,
                                     extra_body={"scenario": "t-items", "distinct": True,
                                                 "exclude": [list(i) for i in CATALOG[:20]]})
    texts = [c.text for c in resp.choices]
    assert len(resp.choices) == 5 and len(set(texts)) == 5, texts


def test_bad_item_controls_over_http(serve_app, catalog):
    r = serve_app.generate({"scenario": "t-items", "prompt": "Items:", "exclude": [[CODES[0]]]})
    assert r.status_code == 422 and "exclude[0]" in r.text, r.text
    r = serve_app.generate({"scenario": "t-items", "prompt": "Items:", "max_new_tokens": 1})
    assert r.status_code == 422 and r.json()["error"]["minimum"] == 2, r.text
    r = serve_app.generate({"scenario": "t-items", "prompt": "Items:", "exclude": "nope"})
    assert r.status_code == 422 and "exclude" in r.text, r.text
    r = requests.post(f"{serve_app.url}/v1/completions", json={"prompt": "Items:", "scenario": "t-items",
                                                                "max_tokens": 4, "exclude": [[1, 2]]}, timeout=60)
    assert r.status_code == 422 and "exclude[0]" in r.text, r.text
