"""``logprobs`` / ``top_logprobs`` with ``engine: vllm``: the distribution each token was sampled from.

vLLM reports them itself (``logprobs_mode="processed_logprobs"``): after our processor's mask, temperature, top-k and
top-p. So every alternative it reports is a token the constraint allows at that step, the sampled token's log
probability is reported, and where every allowed token is among the alternatives their probabilities add up to 1.
The same app as test_vllm_serve.py (conftest.py's ``app``).
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm.v1.engine.async_llm", reason="the vLLM tier runs in .venv-vllm: bash scripts/test_vllm.sh")


pytestmark = pytest.mark.vllm

LABELS = ["Sports", "Technology", "Politics", "New York City", "Science fiction"]
TOP = 5


@pytest.fixture(scope="module")
def labels(app):
    app.put("lp-labels", {"type": "labels", "labels": LABELS})
    return "lp-labels"


def _allowed_paths(tokenizer) -> list[list[int]]:
    """Every token sequence the labels scenario accepts after a chat prompt: a label alone, then EOS."""
    return [tokenizer.encode(label, add_special_tokens=False) + [tokenizer.eos_token_id] for label in LABELS]


def _allowed(prefix: list[int], token: int, paths: list[list[int]]) -> bool:
    seq = prefix + [token]
    return any(path[:len(seq)] == seq for path in paths)


def check_logprobs(out: dict, top: int, paths: list[list[int]]) -> None:
    ids = out["token_ids"]
    assert out["finish_reason"] == "stop" and ids[-1] == paths[0][-1], out
    items = out["logprobs"]
    assert [item["token_id"] for item in items] == ids[:-1]  # the end token is not counted
    for i, item in enumerate(items):
        assert math.isfinite(item["logprob"]) and item["logprob"] <= 1e-6, item  # the sampled token's, reported
        alts = item["top"]
        assert 1 <= len(alts) <= top, item
        assert [a["logprob"] for a in alts] == sorted((a["logprob"] for a in alts), reverse=True)
        for alt in alts:
            assert _allowed(ids[:i], alt["token_id"], paths), (i, alt, out["text"])  # allowed by the constraint
        chosen = next((a for a in alts if a["token_id"] == item["token_id"]), None)
        if chosen is not None:
            assert chosen["logprob"] == pytest.approx(item["logprob"], abs=1e-5)
        n_allowed = len({path[i] for path in paths if path[:i] == ids[:i]})
        if n_allowed <= top:  # every allowed token is reported: the masked distribution sums to 1
            assert len(alts) == n_allowed, (i, alts)
            assert sum(math.exp(a["logprob"]) for a in alts) == pytest.approx(1.0, abs=1e-3), (i, alts)


def test_generate_reports_the_masked_distribution(app, labels, tokenizer):
    paths = _allowed_paths(tokenizer)
    for temperature in (0.0, 1.0):
        r = app.generate({"scenario": labels, "messages": [{"role": "user", "content": "A topic?"}], "n": 2,
                          "temperature": temperature, "seed": 5, "logprobs": TOP})
        assert r.status_code == 200, r.text
        for out in r.json()["outputs"]:
            check_logprobs(out, TOP, paths)


def test_chat_completions_top_logprobs(app, labels, tokenizer, client):
    r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "A topic?"}],
                                       logprobs=True, top_logprobs=3, temperature=1.0, seed=9, n=2,
                                       extra_body={"scenario": labels})
    for choice in r.choices:
        assert choice.message.content in LABELS, choice
        content = choice.logprobs.content
        assert "".join(c.token for c in content) == choice.message.content
        for c in content:
            assert math.isfinite(c.logprob) and 1 <= len(c.top_logprobs) <= 3, c
        eos = tokenizer.decode([tokenizer.eos_token_id])
        for i, c in enumerate(content):
            before = "".join(x.token for x in content[:i])
            for alt in c.top_logprobs:  # the text so far and this token still lead to a label (or end one)
                assert (alt.token == eos and before in LABELS) or any(
                    label.startswith(before + alt.token) for label in LABELS), (before, alt.token)


def _check_items(out: dict, top: int, ends: set[int]) -> None:
    ids = list(out["token_ids"])
    while ids and ids[-1] in ends:
        ids.pop()
    items = out["logprobs"]
    assert [item["token_id"] for item in items] == ids, out
    for item in items:
        assert math.isfinite(item["logprob"]) and item["logprob"] <= 1e-6, item
        assert 1 <= len(item["top"]) <= top and all(math.isfinite(a["logprob"]) for a in item["top"]), item
        assert sum(math.exp(a["logprob"]) for a in item["top"]) <= 1 + 1e-3, item


def test_json_schema_and_stop_strings_keep_their_logprobs(app, tokenizer):
    """A JSON output (checked, regenerated where invalid) and a free-text output cut by a stop string."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    app.put("lp-json", {"type": "json_schema", "schema": schema})
    r = app.generate({"scenario": "lp-json", "messages": [{"role": "user", "content": "A number as JSON."}],
                      "max_new_tokens": 30,
                      "temperature": 1.0, "seed": 2, "n": 2, "logprobs": 3})
    assert r.status_code == 200, r.text
    for out in r.json()["outputs"]:
        _check_items(out, 3, {tokenizer.eos_token_id})
    r = app.generate({"prompt": "Count: 1, 2, 3, 4,", "stop": [" 7"], "max_new_tokens": 24, "temperature": 0,
                      "logprobs": 2})
    assert r.status_code == 200, r.text
    (out,) = r.json()["outputs"]
    _check_items(out, 2, {tokenizer.eos_token_id})
    assert out["logprobs"], out
