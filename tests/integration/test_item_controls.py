"""Item controls with the real model through a replica: exclude, distinct, multi-item
sequences (with a separator and fixed width), the token budget, and the 4xx answers for bad input.

The catalog is a small semantic-id tree (3 levels of 6 codes = 216 items, token ids taken from the vocabulary);
every output is parsed back into items and checked against the catalog and the request's rules.
"""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest

from config import ServerSettings
from item_checks import items_of, product_tree
from deployments.protocol import ServiceError

pytestmark = pytest.mark.integration

CODES = [1000 + 7 * i for i in range(6)]  # ordinary word pieces of SmolLM2's vocabulary
ROOT, SEP = 2000, 2100
CATALOG = [tuple(p) for p in itertools.product(CODES, repeat=3)]


def tree_body(eos: int, mixed: bool = False) -> dict:
    tree = product_tree(ROOT, CODES, 3, eos)
    if mixed:  # one short item, (CODES[0],), beside the three-token ones
        tree["prefix_dict"][f"{ROOT}_{CODES[0]}"] = list(CODES) + [eos]
    return tree


@pytest.fixture(scope="module")
def replica(model, tokenizer):
    from deployments.replica import ModelReplica

    rep = ModelReplica(ServerSettings(), None, model=model, tokenizer=tokenizer)
    yield rep
    rep.shutdown()


@pytest.fixture(scope="module")
def eos(tokenizer):
    return tokenizer.eos_token_id


def run(replica, body):
    return asyncio.run(replica.generate(body))


def refused(replica, body) -> ServiceError:
    with pytest.raises(ServiceError) as info:
        run(replica, body)
    return info.value


def test_exclude_at_temperature_2_never_yields_an_excluded_item(replica, eos):
    rng = random.Random(0)
    excluded = set(rng.sample(CATALOG, 150))
    body = {"inline_scenario": {"type": "tree", "tree": tree_body(eos)}, "prompt": "Recommended items:",
            "exclude": [list(i) for i in sorted(excluded)], "n": 8, "temperature": 2.0, "max_new_tokens": 8}
    produced = []
    for _ in range(13):  # 104 samples, unseeded
        for out in run(replica, body)["outputs"]:
            assert out["finish_reason"] == "stop" and out["token_ids"][-1] == eos, out
            item = tuple(out["token_ids"][:-1])
            assert item in CATALOG and item not in excluded, out
            produced.append(item)
    assert len(produced) >= 100 and len(set(produced)) > 5  # temperature 2 spreads over the free items


def test_distinct_n8_gives_8_different_items(replica, eos):
    body = {"inline_scenario": {"type": "tree", "tree": tree_body(eos)}, "prompt": "Recommended items:",
            "distinct": True, "n": 8, "temperature": 0.7, "max_new_tokens": 8}
    for seed in range(3):
        outs = run(replica, {**body, "seed": seed})["outputs"]
        items = [tuple(o["token_ids"][:-1]) for o in outs]
        assert all(o["finish_reason"] == "stop" for o in outs)
        assert len(items) == 8 and len(set(items)) == 8 and all(i in CATALOG for i in items), items


def test_distinct_with_exactly_n_free_items_takes_all_of_them(replica, eos):
    """208 of 216 items excluded and n=8 distinct at temperature 0: every row must take another free item."""
    free = set(CATALOG[::27])
    assert len(free) == 8
    body = {"inline_scenario": {"type": "tree", "tree": tree_body(eos)}, "prompt": "Recommended items:",
            "exclude": [list(i) for i in CATALOG if i not in free], "distinct": True, "n": 8, "temperature": 0,
            "max_new_tokens": 8}
    outs = run(replica, body)["outputs"]
    assert {tuple(o["token_ids"][:-1]) for o in outs} == free
    err = refused(replica, {**body, "n": 8, "exclude": body["exclude"] + [list(next(iter(free)))]})
    assert err.status == 422 and err.detail["field"] == "n" and err.detail["available"] == 7


def test_beams_with_exclude_are_different_free_items(replica, eos):
    excluded = set(CATALOG[:100])
    body = {"inline_scenario": {"type": "tree", "tree": tree_body(eos)}, "prompt": "Recommended items:",
            "exclude": [list(i) for i in excluded], "distinct": True, "num_beams": 4, "n": 4, "max_new_tokens": 8}
    outs = run(replica, body)["outputs"]
    items = [tuple(o["token_ids"][:-1]) for o in outs]
    assert len(set(items)) == 4 and all(i in CATALOG and i not in excluded for i in items), items


@pytest.mark.parametrize("separator", [SEP, None])
def test_multi_item_sequences_parse_into_distinct_catalog_items(replica, eos, separator):
    rng = random.Random(1)
    excluded = set(rng.sample(CATALOG, 60))
    scenario = {"type": "tree", "tree": tree_body(eos), "max_items": 4, "separator_token_id": separator}
    body = {"inline_scenario": scenario, "prompt": "Recommended items:", "exclude": [list(i) for i in excluded],
            "n": 8, "temperature": 1.5, "max_new_tokens": 40}
    counts = set()
    for seed in range(3):
        for out in run(replica, {**body, "seed": seed})["outputs"]:
            items = items_of(out["token_ids"], eos, separator)
            assert out["finish_reason"] == "stop", out
            assert all(i in CATALOG and i not in excluded for i in items), out
            assert len(set(items)) == len(items) <= 4, out
            counts.add(len(items))
    assert max(counts) > 1  # some rows did go on past one item


@pytest.mark.parametrize("separator", [SEP, None])
def test_output_stopped_for_length_ends_on_an_item_boundary(replica, eos, separator):
    scenario = {"type": "tree", "tree": tree_body(eos), "max_items": 10, "separator_token_id": separator}
    reasons = set()
    for budget in (4, 5, 6, 7, 9, 10):
        body = {"inline_scenario": scenario, "prompt": "Recommended items:", "n": 4, "temperature": 1.5,
                "max_new_tokens": budget, "seed": budget}
        for out in run(replica, body)["outputs"]:
            reasons.add(out["finish_reason"])
            assert len(out["token_ids"]) <= budget
            items = items_of(out["token_ids"], eos, separator)
            assert all(i in CATALOG for i in items) and len(set(items)) == len(items), (budget, out)
    assert "length" in reasons  # some outputs did stop for length, and were still whole items


def test_mixed_depth_budget_picks_the_item_that_fits(replica, eos):
    """With 1 token left only the one-token item fits: the row must take it (never a cut three-token item)."""
    tree = tree_body(eos, mixed=True)
    body = {"inline_scenario": {"type": "tree", "tree": tree}, "prompt": "Recommended items:", "n": 4,
            "temperature": 1.5, "max_new_tokens": 1, "seed": 0}
    for out in run(replica, body)["outputs"]:
        assert out["token_ids"] == [CODES[0]] and out["finish_reason"] == "length", out


def test_labels_exclude_and_distinct(replica):
    labels = ["Sports", "Technology", "Politics", "New York City", "Weather"]
    scenario = {"type": "labels", "labels": labels}
    for seed in range(4):
        outs = run(replica, {"inline_scenario": scenario, "prompt": "Headline: storm hits the coast. Section:",
                             "exclude": ["Weather", "Politics"], "distinct": True, "n": 3, "temperature": 1.5,
                             "seed": seed})["outputs"]
        got = [o["text"].strip() for o in outs]
        assert sorted(got) == ["New York City", "Sports", "Technology"], got
    err = refused(replica, {"inline_scenario": scenario, "prompt": "x", "exclude": ["Weather", "Science"]})
    assert err.status == 422 and "exclude[1]" in err.message and err.detail["field"] == "exclude"


def test_bad_item_controls_are_4xx_naming_the_field(replica, eos):
    tree = {"type": "tree", "tree": tree_body(eos)}
    base = {"inline_scenario": tree, "prompt": "Recommended items:", "max_new_tokens": 8}
    err = refused(replica, {**base, "exclude": [list(CATALOG[0]), [CODES[0], CODES[1]]]})
    assert err.status == 422 and "exclude[1]" in err.message and "not an item" in err.message
    err = refused(replica, {**base, "exclude": [list(CATALOG[0]), "Sports"]})
    assert err.status == 422 and "exclude[1]" in err.message
    err = refused(replica, {**base, "max_new_tokens": 2})
    assert err.status == 422 and err.detail == {"field": "max_new_tokens", "minimum": 3}
    err = refused(replica, {**base, "exclude": [list(CATALOG[0])] * 10_001})
    assert err.status == 422 and err.detail["limit_name"] == "max_exclude_items"
    err = refused(replica, {"inline_scenario": {"type": "regex", "pattern": "[0-9]+"}, "prompt": "x",
                            "distinct": True})
    assert err.status == 422 and err.detail["field"] == "distinct"
    err = refused(replica, {**base, "exclude": [["1"]]})
    assert err.status == 422 and "exclude" in err.message
