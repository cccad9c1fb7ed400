"""The `openai` client against the shared app, as a client moving from vLLM's OpenAI server would call it.

The request shapes are those of vLLM's structured-outputs documentation (``structured_outputs`` with ``choice``,
``regex``, ``json``, ``grammar``; ``response_format`` with ``json_schema``; the older ``guided_choice`` /
``guided_json`` / ``guided_regex`` / ``guided_grammar`` extra fields) and the client's usual calls (``parse`` with a pydantic model, JSON mode, logprobs,
stop, n, seed, streaming). Every answer is checked against its constraint.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from pydantic import BaseModel

pytestmark = pytest.mark.serve

openai = pytest.importorskip("openai")

CHOICES = ["positive", "negative"]
CLASSIFY = [{"role": "user", "content": "Classify this sentiment: vLLM is wonderful!"}]
PHONE = r"[0-9]{3}-[0-9]{4}"
THINK_LABELS = ["yes", "no", "maybe"]


class CarDescription(BaseModel):
    brand: str
    model: str


CAR_SCHEMA = CarDescription.model_json_schema()


@pytest.fixture(scope="module")
def model(client):
    (card,) = client.models.list().data
    return card.id


def _chat(client, model, **kwargs):
    kwargs.setdefault("messages", CLASSIFY)
    return client.chat.completions.create(model=model, **kwargs)


def _valid_json(choice_text, finish_reason, schema=None):
    """A finished JSON answer parses (and validates); one cut by max_tokens is not checked."""
    if finish_reason != "stop":
        return None
    value = json.loads(choice_text)
    if schema is not None:
        jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize("extra", [{"structured_outputs": {"choice": CHOICES}}, {"guided_choice": CHOICES}])
def test_choice_is_exactly_the_label(client, model, extra):
    r = _chat(client, model, extra_body=extra, n=3, temperature=1.5, seed=5)
    assert [c.message.content for c in r.choices if c.message.content not in CHOICES] == []
    assert all(c.finish_reason == "stop" for c in r.choices)
    # raw text continues with a space, as the model would write it
    r = client.completions.create(model=model, prompt="Sentiment of 'vLLM is wonderful!':", extra_body=extra,
                                  temperature=0)
    assert r.choices[0].text in [" " + c for c in CHOICES], r.choices[0].text


def test_choice_streamed(client, model):
    stream = _chat(client, model, extra_body={"structured_outputs": {"choice": CHOICES}}, stream=True, temperature=0)
    content, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert content in CHOICES and finish == "stop"


@pytest.mark.parametrize("extra", [{"structured_outputs": {"regex": PHONE}}, {"guided_regex": PHONE}])
def test_regex(client, model, extra):
    r = _chat(client, model, messages=[{"role": "user", "content": "Give a phone number."}], extra_body=extra,
              n=2, temperature=1.0, seed=2, max_tokens=20)
    for c in r.choices:
        assert c.finish_reason == "stop" and re.fullmatch(PHONE, c.message.content), c


LARK = 'start: "yes" | "no" | NUMBER\nNUMBER: /[0-9]{1,4}/\n'


@pytest.mark.parametrize("extra", [{"structured_outputs": {"grammar": LARK}}, {"guided_grammar": LARK}])
def test_grammar(client, model, extra):
    lark = pytest.importorskip("lark")
    parser = lark.Lark(LARK)
    r = _chat(client, model, messages=[{"role": "user", "content": "Is the sky blue? Say yes, no or a number."}],
              extra_body=extra, n=3, temperature=1.2, seed=3, max_tokens=12)
    for c in r.choices:
        assert c.finish_reason == "stop", c
        parser.parse(c.message.content)  # raises unless the answer is a sentence of the grammar


@pytest.mark.parametrize("extra", [
    {"structured_outputs": {"json": CAR_SCHEMA}},
    {"guided_json": CAR_SCHEMA},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "car-description", "schema": CAR_SCHEMA}}},
])
def test_json_schema(client, model, extra):
    messages = [{"role": "user", "content": "Generate a JSON with the brand and model of the most iconic car."}]
    fmt = extra.pop("response_format", None)
    kwargs = {"response_format": fmt} if fmt else {}
    r = _chat(client, model, messages=messages, extra_body=extra, max_tokens=100, temperature=0, **kwargs)
    c = r.choices[0]
    assert c.finish_reason == "stop", c  # short enough to finish at temperature 0
    _valid_json(c.message.content, c.finish_reason, CAR_SCHEMA)


def test_parse_with_a_pydantic_model(client, model):
    r = client.beta.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Describe a car as JSON."}], response_format=CarDescription,
        temperature=0, max_completion_tokens=60,
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, CarDescription), r
    jsonschema.validate(json.loads(r.choices[0].message.content), CAR_SCHEMA)


def test_json_mode_yields_an_object(client, model):
    r = _chat(client, model, messages=[{"role": "user", "content": "Give a JSON object with a name."}],
              response_format={"type": "json_object"}, n=3, temperature=1.0, seed=4, max_tokens=48)
    done = [c for c in r.choices if c.finish_reason == "stop"]
    for c in done:
        assert isinstance(json.loads(c.message.content), dict), c.message.content
    for c in r.choices:  # cut ones are still the start of an object
        assert c.message.content.startswith("{"), c.message.content


def test_logprobs(client, model):
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.token_logprobs) == len(lp.tokens)
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) == 2 and max(top.values()) == pytest.approx(logprob, abs=1e-4)
    r = _chat(client, model, extra_body={"structured_outputs": {"choice": CHOICES}}, logprobs=True, top_logprobs=3,
              temperature=0)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content in CHOICES
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)


def test_stop_seed_n_and_max_completion_tokens(client, model):
    prompt = "Count: 1, 2, 3, 4,"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0).choices[0]
    assert "," in plain.text, plain
    stopped = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stop=",").choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == plain.text[: plain.text.index(",")]
    ask = {"messages": [{"role": "user", "content": "Say something."}], "n": 2, "temperature": 1.0, "seed": 123,
           "max_completion_tokens": 6}
    first, again = _chat(client, model, **ask), _chat(client, model, **ask)
    assert len(first.choices) == 2 and [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert all(c.finish_reason == "stop" or len(c.message.content) > 0 for c in first.choices)
    assert first.usage.completion_tokens <= 12


def test_beams_in_the_extra_body(client, model):
    r = _chat(client, model, n=2, extra_body={"structured_outputs": {"choice": CHOICES}, "num_beams": 2})
    assert sorted(c.message.content for c in r.choices) == sorted(CHOICES)
    # each choice carries the score it was ranked by (an extra field), best first; a sampled choice carries null
    scores = [c.model_extra["score"] for c in r.choices]
    assert all(isinstance(s, float) and s <= 0 for s in scores) and scores == sorted(scores, reverse=True), scores
    sampled = _chat(client, model, n=2, temperature=1.0, extra_body={"structured_outputs": {"choice": CHOICES}})
    assert [c.model_extra["score"] for c in sampled.choices] == [None, None]


def test_think_scenario_reasoning_apart(client, model, serve_app):
    serve_app.put("t-think-oa", {"type": "labels", "labels": THINK_LABELS, "think": {"max_thinking_tokens": 10}})
    r = _chat(client, model, messages=[{"role": "user", "content": "Is the sky blue?"}],
              extra_body={"scenario": "t-think-oa"}, temperature=0)
    message = r.choices[0].message
    assert message.content in THINK_LABELS and "</think>" not in (message.reasoning_content or "x</think>"), message
    stream = _chat(client, model, messages=[{"role": "user", "content": "Is the sky blue?"}],
                   extra_body={"scenario": "t-think-oa"}, temperature=0, stream=True)
    reasoning, content = "", ""
    for chunk in stream:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)


def test_refusals_name_the_problem(client, model):
    with pytest.raises(openai.NotFoundError) as error:
        _chat(client, "gpt-4o")
    assert "gpt-4o" in error.value.message
    with pytest.raises(openai.BadRequestError) as error:
        _chat(client, model, extra_body={"frobnicate": True})
    assert "frobnicate" in error.value.message
    with pytest.raises(openai.BadRequestError) as error:
        _chat(client, model, frequency_penalty=0.7)
    assert "frequency_penalty" in error.value.message
    with pytest.raises(openai.BadRequestError) as error:
        _chat(client, model, logprobs=True, stream=True)
    assert "logprobs" in error.value.message
