"""What a replica (real model and tokenizer) hands back: the label form per prompt kind, a think scenario's
thinking and answer apart, stop strings, log probabilities.

Every constrained answer is checked against its label set; stop strings against the text the model produced.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from config import ServerSettings
from deployments.replica.answer import TextWatch, split_thinking, unsure_tail

LABELS = ["Sports", "Technology", "Politics", "New York City"]
CHAT = [{"role": "user", "content": "Which section does this headline belong to: 'Team wins the cup'?"}]


@pytest.fixture(scope="module")
def replica(model, tokenizer):
    from deployments.replica import ModelReplica

    rep = ModelReplica(ServerSettings(), None, model=model, tokenizer=tokenizer)
    yield rep
    rep.shutdown()


def run(replica, body):
    return asyncio.run(replica.generate(body))


def stream(replica, body):
    async def collect():
        return [event async for event in replica.generate_stream({**body, "stream": True})]

    return asyncio.run(collect())


@pytest.mark.parametrize("multi", [False, True])
def test_label_form_follows_the_prompt(replica, multi):
    labels = {"type": "labels", "labels": LABELS, "multi_label": multi}
    chat = run(replica, {"inline_scenario": labels, "messages": CHAT, "n": 4, "temperature": 1.5, "seed": 1})
    raw = run(replica, {"inline_scenario": labels, "prompt": "Headline: Team wins the cup. Section:", "n": 4,
                        "temperature": 1.5, "seed": 1})
    after_newline = run(replica, {"inline_scenario": labels, "prompt": "Headline: Team wins the cup.\nSection:\n",
                                  "n": 2, "temperature": 1.5, "seed": 1})
    for out in chat["outputs"] + after_newline["outputs"]:  # starts a message: no leading space
        assert out["finish_reason"] == "stop", out
        parts = out["text"].split(",") if multi else [out["text"]]
        assert all(part in LABELS for part in parts) and len(set(parts)) == len(parts), out["text"]
    for out in raw["outputs"]:  # continues text: one leading space before each label
        assert out["finish_reason"] == "stop", out
        parts = out["text"].split(",") if multi else [out["text"]]
        assert all(part.startswith(" ") and part[1:] in LABELS for part in parts), out["text"]


def test_think_answer_and_reasoning_apart(replica):
    scenario = {"type": "labels", "labels": LABELS, "think": {"max_thinking_tokens": 12}}
    result = run(replica, {"inline_scenario": scenario, "messages": CHAT, "n": 2, "temperature": 1.0, "seed": 3})
    for out in result["outputs"]:
        assert out["finish_reason"] == "stop", out
        assert out["answer"] in LABELS, out  # the answer alone, in the bare form
        assert out["text"] == out["reasoning_content"] + "</think>\n\n" + out["answer"], out
        assert "</think>" not in out["reasoning_content"]
    events = stream(replica, {"inline_scenario": scenario, "messages": CHAT, "temperature": 0})
    tokens = [e for e in events if e["type"] == "token"]
    reasoning = "".join(e["reasoning"] for e in tokens)
    answer = "".join(e["answer"] for e in tokens)
    final = events[-1]["response"]["outputs"][0]
    assert (reasoning, answer) == (final["reasoning_content"], final["answer"]) and answer in LABELS


def test_stop_strings_end_outputs(replica):
    free = {"prompt": "Count: 1, 2, 3, 4, 5, 6,", "max_new_tokens": 24, "temperature": 0}
    plain = run(replica, free)["outputs"][0]
    assert "," in plain["text"], plain  # the model continues the list
    cut = plain["text"].index(",")
    stopped = run(replica, {**free, "stop": [",", "never-there"]})["outputs"][0]
    assert stopped["finish_reason"] == "stop" and stopped["text"] == plain["text"][:cut], (plain, stopped)
    assert len(stopped["token_ids"]) < len(plain["token_ids"])
    events = stream(replica, {**free, "stop": [","]})
    text = "".join(e.get("text") or "" for e in events if e["type"] == "token")
    assert text == stopped["text"] and events[-1]["response"]["outputs"][0]["text"] == stopped["text"]
    unmatched = run(replica, {**free, "stop": ["zzzz"]})["outputs"][0]
    assert unmatched["text"] == plain["text"]


@pytest.mark.parametrize("scenario", [{"type": "json_schema", "schema": {"type": "object"}},
                                      {"type": "labels", "labels": LABELS}])
def test_stop_strings_never_cut_constrained_outputs(replica, scenario):
    """``stop`` is accepted with a constraint (agent libraries send it) and cuts nothing: the
    constraint ends the output (it used to be a 400). The stop strings are ones these outputs hold."""
    body = {"inline_scenario": scenario, "messages": CHAT, "max_new_tokens": 48, "temperature": 0}
    plain = run(replica, body)["outputs"][0]
    stops = ["{", "}", "\"", ":", "o", "e", " "]
    stopped = run(replica, {**body, "stop": stops})["outputs"][0]
    assert stopped == plain, (plain, stopped)
    assert any(s in plain["text"] for s in stops), plain  # a stop string would have cut it
    events = stream(replica, {**body, "stop": stops})
    assert "".join(e.get("text") or "" for e in events if e["type"] == "token") == plain["text"]
    assert events[-1]["response"]["outputs"][0]["text"] == plain["text"]


def test_logprobs_are_the_models(replica, model, tokenizer):
    body = {"prompt": "The capital of France is", "max_new_tokens": 4, "temperature": 0, "logprobs": 3}
    out = run(replica, body)["outputs"][0]
    items = out["logprobs"]
    assert [i["token_id"] for i in items] == [t for t in out["token_ids"] if t != tokenizer.eos_token_id]
    assert "".join(i["token"] for i in items) == out["text"]
    for item in items:  # greedy: the chosen token is the most likely one, and listed first
        assert len(item["top"]) == 3 and item["top"][0]["token_id"] == item["token_id"]
        assert item["logprob"] <= 0 and math.isclose(item["top"][0]["logprob"], item["logprob"], abs_tol=1e-4)
        assert item["top"][0]["logprob"] >= item["top"][1]["logprob"] >= item["top"][2]["logprob"]
    assert run(replica, {**body, "logprobs": None})["outputs"][0].get("logprobs") is None  # omitted when not asked


def test_text_watch_and_split_pieces():
    watch = TextWatch(["END", "\n\n"])
    assert watch.update("abc E") == "abc "  # "E" may become "END"
    assert watch.update("abc EN") == "abc "
    assert watch.update("abc ENX") == "abc ENX" and not watch.stopped
    assert watch.update("abc ENX\n\nmore") == "abc ENX" and watch.stopped and watch.text == "abc ENX"
    assert unsure_tail("xx</thi", ["</think>"]) == 5
    assert split_thinking("hmm</thi", "</think>", final=False) == ("hmm", "")
    assert split_thinking("hmm</thi", "</think>") == ("hmm</thi", "")
    assert split_thinking("hmm</think>\n\n Yes", "</think>") == ("hmm", "Yes")


def test_console_replay_follows_the_label_form(tokenizer):
    """The web console replays a generated answer without its prompt: both forms replay as allowed."""
    from processors.scenarios import load_scenario
    from deployments.console import replay
    from processors import compile_scenario

    compiled = compile_scenario(load_scenario({"type": "labels", "labels": LABELS}), tokenizer)
    eos = tokenizer.eos_token_id
    for text in ("Sports", " Sports", "New York City", " New York City"):
        ids = tokenizer.encode(text, add_special_tokens=False) + [eos]
        report = replay(compiled, tokenizer, ids)
        assert report["error"] is None and report["finished"], (text, report["error"])
    wrong = tokenizer.encode(" Sports", add_special_tokens=False)[:1] + tokenizer.encode("Sports", add_special_tokens=False)
    assert replay(compiled, tokenizer, wrong)["error"] is not None  # one form per answer, not a mix
