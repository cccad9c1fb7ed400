"""config.json_span.object_field_span: the byte span of a top-level object field, found with array passes, checked
against Python's own JSON parser on bodies written many ways; every body it cannot split certainly gives None."""

from __future__ import annotations

import json
import random

import pytest

from config.json_span import object_field_span


def _bodies():
    tree = {"start_token_id": 1, "end_token_id": 2, "sep": "_", "prefix_dict": {"1": [5, 6], "1_5": [2], "1_6": [2]}}
    shapes = [
        {"type": "tree", "tree": tree},
        {"tree": tree, "type": "tree", "max_items": 2},
        {"type": "tree", "think": {"max_thinking_tokens": 4}, "tree": tree, "settings": {"stop": ["}", "]", "{"]}},
        {"labels": ["tree", "{", "[x]"], "type": "tree", "tree": {**tree, "note": {"tree": {"a": [1, {"b": []}]}}}},
        {"tree": {}, "x": [[], {}, [{"tree": 3}]]},
        {"a\u00e9": "\u00fc {", "tree": {"k": "}]["}},
    ]
    for body in shapes:
        for kw in ({}, {"indent": 2}, {"separators": (",", ":")}, {"ensure_ascii": False}, {"indent": "\t"}):
            yield body, json.dumps(body, **kw).encode()


@pytest.mark.parametrize("body,raw", list(_bodies()))
def test_span_is_the_field_value(body, raw):
    span = object_field_span(raw, "tree")
    if b"\\" in raw:  # ensure_ascii wrote escapes: those bodies are parsed whole
        assert span is None
        return
    assert span is not None
    start, end = span
    assert json.loads(raw[start:end]) == body["tree"]
    # what is left, with null in the tree's place, is the body without its tree
    assert json.loads(raw[:start] + b"null" + raw[end:]) == {**body, "tree": None}


@pytest.mark.parametrize("raw", [
    b"",
    b"[]",
    b'{"type": "tree"}',  # no tree
    b'{"tree": [1, 2]}',  # not an object
    b'{"tree": null}',
    b'{"tree": {}, "tree": {}}',  # given twice
    b'{"tree": {"a": "\\"{"}}',  # a backslash: escapes are not followed
    b'{"tree": {"a": 1}',  # unbalanced
    b'{"tree": {"a": 1}}}',
    b'{"tree": {"a": 1]}',  # mismatched
    b'{"tree": {"a": "1}}',  # odd quotes
    b'{"x": {"tree": {}}}',  # only nested
    b'{"tree": {}} {"tree": {}}',  # two documents
])
def test_what_cannot_be_split_certainly_is_none(raw):
    assert object_field_span(raw, "tree") is None


def test_random_trees_round_trip():
    rng = random.Random(7)
    for _ in range(50):
        prefix_dict = {"_".join(map(str, [1] + [rng.randrange(3, 99) for _ in range(rng.randrange(0, 4))])):
                       [rng.randrange(0, 200) for _ in range(rng.randrange(0, 5))] for _ in range(rng.randrange(1, 40))}
        body = {"type": "tree", "tree": {"start_token_id": 1, "end_token_id": 2, "prefix_dict": prefix_dict},
                **({"settings": {"temperature": 0}} if rng.random() < 0.5 else {})}
        items = list(body.items())
        rng.shuffle(items)
        raw = json.dumps(dict(items), indent=rng.choice([None, 1])).encode()
        start, end = object_field_span(raw, "tree")
        assert json.loads(raw[start:end]) == body["tree"]
