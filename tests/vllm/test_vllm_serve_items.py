"""Item controls on ``engine: vllm`` end to end over real HTTP: ``exclude``,
``distinct`` across the ``n`` rows of a request (separate vLLM requests sharing one book in vLLM's worker),
multi-item scenarios with a separator and fixed width, the token budget, labels, the 4xx answers, and a cancelled
stream. The transformers backend's semantics (tests/integration/test_item_controls.py): every output is parsed
back into items and checked against the catalog, the exclusions, distinctness and the limits.
"""

from __future__ import annotations

import itertools
import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm.v1.engine.async_llm", reason="the vLLM tier runs in .venv-vllm: bash scripts/test_vllm.sh")

import requests  # noqa: E402
from item_checks import items_of, product_tree  # noqa: E402

pytestmark = pytest.mark.vllm

CODES = [1000 + 7 * i for i in range(6)]  # ordinary word pieces of SmolLM2's vocabulary
ROOT, SEP = 2000, 2100
CATALOG = [tuple(p) for p in itertools.product(CODES, repeat=3)]  # 216 three-token items
LABELS = ["Sports", "Technology", "Politics", "New York City", "Weather"]
PROMPT = "Recommended items:"


@pytest.fixture(scope="module")
def eos(app, tokenizer):
    eos = tokenizer.eos_token_id
    tree = product_tree(ROOT, CODES, 3, eos)
    app.put("vi-tree", {"type": "tree", "tree": tree})
    app.put("vi-sep", {"type": "tree", "tree": tree, "max_items": 4, "separator_token_id": SEP})
    app.put("vi-fixed", {"type": "tree", "tree": tree, "max_items": 4})
    app.put("vi-long", {"type": "tree", "tree": tree, "max_items": 10, "separator_token_id": SEP})
    app.put("vi-long-fixed", {"type": "tree", "tree": tree, "max_items": 10})
    app.put("vi-labels", {"type": "labels", "labels": LABELS})
    app.put("vi-think", {"type": "labels", "labels": LABELS, "think": {"max_thinking_tokens": 6}})
    return eos


def generate(app, body: dict) -> list[dict]:
    r = app.generate(body, timeout=300)
    assert r.status_code == 200, r.text
    outs = r.json()["outputs"]
    assert len(outs) == body.get("n", 1)
    return outs


def single_items(outs: list[dict], eos: int, excluded=frozenset()) -> list[tuple[int, ...]]:
    """Each output is one whole catalog item ended by EOS, not excluded."""
    items = []
    for out in outs:
        assert out["error"] is None and out["finish_reason"] == "stop" and out["token_ids"][-1] == eos, out
        item = tuple(out["token_ids"][:-1])
        assert item in CATALOG and item not in excluded, out
        items.append(item)
    return items


def test_exclude_never_yields_an_excluded_item(app, eos):
    excluded = set(random.Random(0).sample(CATALOG, 150))
    body = {"scenario": "vi-tree", "prompt": PROMPT, "exclude": [list(i) for i in sorted(excluded)], "n": 8,
            "max_new_tokens": 8}
    produced = []
    for temperature in (2.0, 3.0, 3.0):  # 3.0: above vLLM's 2, the processor scales the logits
        produced += single_items(generate(app, {**body, "temperature": temperature}), eos, excluded)
    assert len(set(produced)) > 3  # high temperatures spread over the free items


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.5])
def test_distinct_rows_are_different_items(app, eos, temperature):
    """At temperature 0 the 8 rows of a request would all take the model's favourite item: distinct must still
    give 8 different ones (rows deciding together draw in turn in the processor)."""
    body = {"scenario": "vi-tree", "prompt": PROMPT, "distinct": True, "n": 8, "temperature": temperature,
            "max_new_tokens": 8, "seed": 5}
    items = single_items(generate(app, body), eos)
    assert len(set(items)) == 8, items


def test_distinct_with_exactly_n_free_items_takes_all_of_them(app, eos):
    free = set(CATALOG[::27])
    assert len(free) == 8
    body = {"scenario": "vi-tree", "prompt": PROMPT, "exclude": [list(i) for i in CATALOG if i not in free],
            "distinct": True, "n": 8, "temperature": 0, "max_new_tokens": 8}
    items = single_items(generate(app, body), eos)
    assert set(items) == free and len(items) == 8
    r = app.generate({**body, "exclude": body["exclude"] + [list(next(iter(free)))]})
    assert r.status_code == 422 and r.json()["error"]["field"] == "n" and r.json()["error"]["available"] == 7, r.text


def test_concurrent_distinct_requests_keep_their_own_books(app, eos):
    """Six distinct requests at once (48 rows in vLLM's batch of 16, so rows of one request join at different
    steps): each request's rows are different items, its exclusions hold; requests do not constrain each other."""
    rng = random.Random(3)

    def one(k):
        excluded = set(rng.sample(CATALOG, 200))
        body = {"scenario": "vi-tree", "prompt": PROMPT, "exclude": [list(i) for i in excluded], "distinct": True,
                "n": 8, "temperature": 0 if k % 2 else 1.0, "max_new_tokens": 8}
        return excluded, generate(app, body)

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(6)))
    for excluded, outs in results:
        items = single_items(outs, eos, excluded)
        assert len(set(items)) == 8, items


@pytest.mark.parametrize("name,sep", [("vi-sep", SEP), ("vi-fixed", None)])
@pytest.mark.parametrize("distinct", [False, True])
def test_multi_item_outputs_parse_into_catalog_items(app, eos, name, sep, distinct):
    excluded = set(random.Random(1).sample(CATALOG, 60))
    body = {"scenario": name, "prompt": PROMPT, "exclude": [list(i) for i in excluded], "n": 6,
            "temperature": 1.5, "max_new_tokens": 40, "distinct": distinct}
    every, counts = [], set()
    for seed in range(2):
        for out in generate(app, {**body, "seed": seed}):
            assert out["error"] is None and out["finish_reason"] == "stop", out
            items = items_of(out["token_ids"], eos, sep)
            assert all(i in CATALOG and i not in excluded for i in items), out
            assert len(set(items)) == len(items) <= 4, out  # a row's own items never repeat; max_items
            counts.add(len(items))
            every.append(items)
        if distinct:  # across the rows of the request too
            mine = [i for items in every[-6:] for i in items]
            assert len(set(mine)) == len(mine), every[-6:]
    assert max(counts) > 1  # some rows did go on past one item


@pytest.mark.parametrize("name,sep", [("vi-long", SEP), ("vi-long-fixed", None)])
def test_output_stopped_for_length_ends_on_an_item_boundary(app, eos, name, sep):
    reasons = set()
    for budget in (4, 5, 6, 7, 9, 10):  # length only where a whole item ends exactly at the budget
        body = {"scenario": name, "prompt": PROMPT, "n": 4, "temperature": 1.5, "max_new_tokens": budget,
                "seed": budget, "distinct": budget % 2 == 1}
        outs = generate(app, body)
        for out in outs:
            reasons.add(out["finish_reason"])
            assert out["error"] is None and len(out["token_ids"]) <= budget, (budget, out)
            items = items_of(out["token_ids"], eos, sep)
            assert all(i in CATALOG for i in items) and len(set(items)) == len(items), (budget, out)
        if body["distinct"]:
            every = [i for out in outs for i in items_of(out["token_ids"], eos, sep)]
            assert len(set(every)) == len(every), outs
    assert "length" in reasons  # some outputs did stop for length, and were still whole items


def test_labels_exclude_and_distinct(app, eos):
    for seed in range(3):
        outs = generate(app, {"scenario": "vi-labels", "prompt": "Headline: storm hits the coast. Section:",
                              "exclude": ["Weather", "Politics"], "distinct": True, "n": 3, "temperature": 1.5,
                              "seed": seed})
        got = sorted(o["text"].strip() for o in outs)
        assert got == ["New York City", "Sports", "Technology"], got


def test_item_controls_as_openai_extra_body(app, eos, client):
    excluded = CATALOG[:200]
    resp = client.completions.create(model="default", prompt=PROMPT, max_tokens=8, n=5, temperature=0,
                                     extra_body={"scenario": "vi-tree", "distinct": True,
                                                 "exclude": [list(i) for i in excluded]})
    texts = [c.text for c in resp.choices]
    assert len(resp.choices) == 5 and len(set(texts)) == 5, texts


def test_bad_item_controls_are_4xx(app, eos):
    r = app.generate({"scenario": "vi-tree", "prompt": PROMPT, "exclude": [[CODES[0]]]})
    assert r.status_code == 422 and "exclude[0]" in r.text, r.text
    r = app.generate({"scenario": "vi-tree", "prompt": PROMPT, "max_new_tokens": 2})
    assert r.status_code == 422 and r.json()["error"]["minimum"] == 3, r.text
    r = app.generate({"scenario": "vi-labels", "prompt": "Topic:", "exclude": ["Nope"]})
    assert r.status_code == 422 and "exclude[0]" in r.text, r.text


def test_a_cancelled_distinct_stream_leaves_later_requests_whole(app, eos):
    """A distinct request whose stream is closed after its first token (its vLLM requests aborted), then the same
    request again: all 8 free items, as if the first had never run."""
    free = set(CATALOG[5::27])
    body = {"scenario": "vi-tree", "prompt": PROMPT, "exclude": [list(i) for i in CATALOG if i not in free],
            "distinct": True, "n": 8, "temperature": 0, "max_new_tokens": 8}
    with requests.post(f"{app.url}/v1/generate", json={**body, "stream": True}, stream=True, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines(decode_unicode=True):
            if line and line.startswith("data: ") and json.loads(line[len("data: "):]).get("type") == "token":
                break
    assert set(single_items(generate(app, body), eos)) == free


def test_think_mode_with_item_controls(app, eos, tokenizer):
    """Thinking first (its rows decide no item), then distinct labels, not excluded; the budget leaves room for the
    end marker and a label."""
    from vllm_checks import check_output

    body = {"type": "labels", "labels": LABELS, "think": {"max_thinking_tokens": 6}}
    for seed in range(2):
        outs = generate(app, {"scenario": "vi-think", "messages": [{"role": "user", "content": "A section?"}],
                              "exclude": ["Weather", "Sports"], "distinct": True, "n": 3, "temperature": 1.2,
                              "max_new_tokens": 24, "seed": seed})
        answers = []
        for out in outs:
            assert out["error"] is None, out
            check_output("labels", body, out["text"], out["token_ids"], out["finish_reason"], tokenizer)
            end = tokenizer.encode("</think>\n\n", add_special_tokens=False)
            ids = out["token_ids"]
            at = next(i for i in range(len(ids)) if ids[i: i + len(end)] == end)
            answers.append(tokenizer.decode(ids[at + len(end):], skip_special_tokens=True).strip())
        assert sorted(answers) == ["New York City", "Politics", "Technology"], answers


def test_logprobs_of_a_distinct_request(app, eos):
    """Rows drawn in turn by the processor report their token with log probability 0 (vLLM saw that one token);
    the outputs are whole, different items all the same."""
    body = {"scenario": "vi-tree", "prompt": PROMPT, "distinct": True, "n": 4, "temperature": 1.0, "seed": 2,
            "max_new_tokens": 8, "logprobs": 2}
    outs = generate(app, body)
    assert len(set(single_items(outs, eos))) == 4
    for out in outs:
        assert [item["token_id"] for item in out["logprobs"]] == out["token_ids"][:-1], out
        for item in out["logprobs"]:
            assert item["logprob"] <= 1e-6 and all(a["token_id"] in CODES for a in item["top"]), item


def test_filters_over_item_metadata(app, eos, client):
    """A catalog with item metadata (a default filter in its header) and request filters on engine vllm: the filter
    is resolved again in vLLM's worker on its copy of the version; every output passes the request's filter and the
    scenario's (checked with the filter language's rules, item_checks.filter_passes), under greedy, sampling with
    n and distinct, and as an OpenAI extra field; a bad filter is a 422 naming its field."""
    from item_checks import filter_passes

    meta = {item: {"region": ["eu", "us", "apac"][i % 3], "stock": i % 5} for i, item in enumerate(CATALOG)}
    head = {"start_token_id": ROOT, "end_token_id": eos, "max_new_tokens": 8, "append_start_token": True,
            "filter": {"stock": {"$gt": 0}}}
    lines = [json.dumps(head)] + [json.dumps({"ids": list(k), "metadata": v}) for k, v in meta.items()]
    r = requests.put(f"{app.url}/admin/scenarios/vi-meta", data=("\n".join(lines) + "\n").encode(), timeout=300,
                     headers={**app.admin, "Content-Type": "application/x-ndjson"})
    assert r.status_code == 200, r.text

    def passing(flt):
        return {k for k, v in meta.items() if filter_passes(v, head["filter"]) and filter_passes(v, flt or {})}

    for flt, extra in [(None, {}), ({"region": "eu"}, {}), ({"region": {"$in": ["us", "apac"]}, "stock": {"$lte": 2}},
                                                           {"n": 4, "distinct": True, "temperature": 1.2, "seed": 4})]:
        body = {"scenario": "vi-meta", "prompt": PROMPT, **extra}
        if flt is not None:
            body["filter"] = flt
        items = single_items(generate(app, body), eos)
        assert set(items) <= passing(flt), (flt, items)
        assert len(set(items)) == len(items)
    resp = client.completions.create(model="default", prompt=PROMPT, max_tokens=8, n=3, temperature=1.2, seed=2,
                                     extra_body={"scenario": "vi-meta", "distinct": True, "filter": {"region": "apac"}})
    assert len(resp.choices) == 3 and len({c.text for c in resp.choices}) == 3
    r = app.generate({"scenario": "vi-meta", "prompt": PROMPT, "filter": {"colour": "red"}})
    assert r.status_code == 422 and r.json()["error"]["field"] == "filter.colour", r.text
