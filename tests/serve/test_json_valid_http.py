"""JSON schemas the grammar cannot enforce, over real HTTP against the shared Serve app: ``strict: true`` refuses
them at PUT (naming the keywords, nothing stored), without it they are served and each output reports its
attempts (native and OpenAI routes). Every output returned with ``finish_reason: stop`` is checked against the
schema here.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import requests

pytestmark = pytest.mark.serve

#: uniqueItems and not: dropped from the grammar, checked after generation
TAGS = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 2,
                            "uniqueItems": True}},
    "required": ["tags"],
    "additionalProperties": False,
    "not": {"properties": {"tags": {"contains": {"const": "c"}}}},
}


def _no_repeats(pairs):
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"repeated key in {keys}"
    return dict(pairs)


def _check(text: str) -> None:
    jsonschema.validate(json.loads(text, object_pairs_hook=_no_repeats), TAGS)


def test_strict_put_refuses_unenforceable_keywords_and_stores_nothing(serve_app):
    url = f"{serve_app.url}/admin/scenarios/t-strict-tags"
    r = requests.put(url, json={"type": "json_schema", "strict": True, "schema": TAGS}, headers=serve_app.admin,
                     timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "strict: true" in error["message"]
    assert "uniqueItems at #/properties/tags" in error["message"] and "not at #" in error["message"]
    assert set(error["unenforced"]) == {"uniqueItems at #/properties/tags", "not at #"}
    assert requests.get(url, headers=serve_app.admin, timeout=30).status_code == 404  # nothing stored
    # an exactly enforced schema passes strict
    exact = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    assert serve_app.put("t-strict-exact", {"type": "json_schema", "strict": True, "schema": exact})["version"] >= 1


def test_relaxed_schema_served_with_attempts_reported(serve_app):
    serve_app.put("t-tags", {"type": "json_schema", "schema": TAGS})
    r = serve_app.generate({"scenario": "t-tags", "prompt": "Two tags as JSON:", "n": 4, "temperature": 1.2,
                            "seed": 5, "max_new_tokens": 24})
    assert r.status_code == 200, r.text
    for out in r.json()["outputs"]:
        assert out["attempts"] >= 1
        if out["finish_reason"] == "stop":
            _check(out["text"])
        else:
            assert out["finish_reason"] in ("length", "error"), out


def test_openai_choices_carry_attempts(serve_app):
    body = {"model": "default", "messages": [{"role": "user", "content": "Two tags as JSON."}], "n": 2,
            "temperature": 1.2, "seed": 9, "max_tokens": 24,
            "response_format": {"type": "json_schema", "json_schema": {"name": "tags", "schema": TAGS}}}
    r = requests.post(f"{serve_app.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["attempts"] >= 1
        if choice["finish_reason"] == "stop":
            _check(choice["message"]["content"])
        elif choice["finish_reason"] == "error":
            assert choice["error"].startswith("invalid output after"), choice
