"""``stop`` is accepted on every request, with the real ``openai`` client against the shared app.

Agent libraries send ``stop`` with constrained requests (smolagents' ToolCallingAgent with its tool requests:
``["Observation:", "Calling tools:"]``), and OpenAI and vLLM accept it; it used to be a 400 ``stop strings apply to
free text only``. Now stop strings cut free text only: a constrained output (a JSON document, tool calls, the JSON
string of a ``tool_choice: auto`` text answer) ends where its constraint ends it, whatever stop strings it holds.
The stop strings below are ones every such output holds (``{``, ``"``, ``:``), so a cut would show.
"""

from __future__ import annotations

import json

import pytest

from tool_checks import check_calls, chat, openai_model

pytestmark = pytest.mark.serve

# every JSON object and every tool call holds these; smolagents' own stop strings come first
STOPS = ["Observation:", "Calling tools:", "{", "\"", ":", "}", ",", "\n"]


@pytest.fixture(scope="module")
def model(client):
    return openai_model(client)


def test_json_object_with_stop_is_whole_json(client, model):
    messages = [{"role": "user", "content": "Describe a cat as a JSON object with a name and an age."}]
    r = client.chat.completions.create(model=model, messages=messages, response_format={"type": "json_object"},
                                       stop=STOPS, max_tokens=64, temperature=0)
    (choice,) = r.choices
    assert choice.finish_reason == "stop", choice
    value = json.loads(choice.message.content)  # whole: not cut at its first "{" or '"'
    assert isinstance(value, dict), choice.message.content
    # streamed: the same whole document
    stream = client.chat.completions.create(model=model, messages=messages, response_format={"type": "json_object"},
                                            stop=STOPS, max_tokens=64, temperature=0, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_tool_calls_with_stop_are_whole_calls(client, model):
    r = chat(client, model, tool_choice="required", stop=STOPS, n=2, temperature=1.0, seed=5)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert check_calls(choice.message.tool_calls)  # each names a tool, its arguments satisfy its parameters
    # tool_choice auto: a call or a text answer, neither cut (the answer is the JSON string the grammar ends)
    (choice,) = chat(client, model, tool_choice="auto", stop=STOPS).choices
    if choice.finish_reason == "tool_calls":
        assert check_calls(choice.message.tool_calls)
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content is not None, choice


def test_free_text_is_still_cut_by_stop(client, model):
    prompt = "Count: 1, 2, 3, 4, 5, 6,"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0).choices[0]
    assert "," in plain.text, plain.text  # the model continues the list
    cut = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stop=[","]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == plain.text[:plain.text.index(",")], (plain, cut)
    messages = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0)
    content = whole.choices[0].message.content
    assert "\n" in content.strip(), content  # one number a line
    stopped = client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0,
                                             stop=["\n"]).choices[0]
    assert stopped.finish_reason == "stop" and stopped.message.content == content[:content.index("\n")], stopped
