"""Tool calls on ``POST /v1/chat/completions`` with the real ``openai`` client against the shared app.

``tools`` + ``tool_choice`` (``none``, ``auto``, ``required``, a named function) + ``parallel_tool_calls``:
every call the service returns is checked here, with ``jsonschema``, against the tool set (its name is one of the
tools, its arguments satisfy that function's ``parameters``); streamed calls are reassembled from their deltas.
Also: a conversation that carries an assistant's calls and ``tool`` results, ``parse`` with a pydantic tool, and
the refusals (each names its field).
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tool_checks import ASK, TOOLS, chat, check_calls, openai_model

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def model(client):
    return openai_model(client)


def test_named_tool_is_exactly_one_call_of_it(client, model):
    r = chat(client, model, tool_choice={"type": "function", "function": {"name": "get_time"}}, n=2, temperature=1.0,
              seed=3)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        (call,) = check_calls(choice.message.tool_calls)
        assert call[0] == "get_time"


def test_required_without_parallel_calls_is_one_call(client, model):
    r = chat(client, model, tool_choice="required", parallel_tool_calls=False)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    check_calls(choice.message.tool_calls)


def test_required_with_parallel_calls_is_one_or_more_calls(client, model):
    r = chat(client, model, tool_choice="required", max_tokens=160, n=2, temperature=1.0, seed=11)
    for choice in r.choices:
        if choice.finish_reason == "length":  # several calls may not end within max_tokens: then no call at all
            assert not choice.message.tool_calls
            continue
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) >= 1
        check_calls(choice.message.tool_calls)
    assert any(c.finish_reason == "tool_calls" for c in r.choices)


def test_auto_answers_in_text_or_calls(client, model):
    r = chat(client, model, tool_choice="auto", n=4, temperature=1.2, seed=7, max_tokens=60)
    for choice in r.choices:
        if choice.finish_reason == "tool_calls":
            assert choice.message.content is None and check_calls(choice.message.tool_calls)
        elif choice.finish_reason == "stop":
            assert isinstance(choice.message.content, str) and not choice.message.tool_calls
        else:
            assert choice.finish_reason == "length" and not choice.message.tool_calls


def test_auto_is_the_default_with_tools(client, model):
    r = chat(client, model, parallel_tool_calls=False)
    (choice,) = r.choices
    assert choice.finish_reason in ("tool_calls", "stop", "length")
    if choice.finish_reason == "tool_calls":
        assert len(check_calls(choice.message.tool_calls)) == 1


def test_none_answers_in_text(client, model):
    r = chat(client, model, tool_choice="none", max_tokens=12)
    (choice,) = r.choices
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert isinstance(choice.message.content, str) and choice.message.content


def test_streamed_calls_reassemble(client, model):
    stream = chat(client, model, tool_choice="required", stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            assert not choice.delta.content
            for part in choice.delta.tool_calls or []:
                if part.index not in calls:  # the first delta of a call: id, type, name
                    assert part.id.startswith("call_") and part.type == "function" and part.function.name
                    calls[part.index] = {"id": part.id, "name": part.function.name, "arguments": ""}
                else:
                    assert part.id is None
                calls[part.index]["arguments"] += part.function.arguments or ""
    assert finish == "tool_calls" and calls
    for call in calls.values():
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call["name"])
        jsonschema.validate(json.loads(call["arguments"]), schema)


def test_streamed_text_under_none(client, model):
    stream = chat(client, model, tool_choice="none", stream=True, max_tokens=8)
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            assert not choice.delta.tool_calls
            finish = choice.finish_reason or finish
    assert text and finish in ("stop", "length")


def test_a_conversation_with_a_tool_result(client, model):
    first = chat(client, model, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = first.choices[0].message.tool_calls
    messages = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}]
    r = chat(client, model, messages=messages, tool_choice="none", max_tokens=16)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None
    r = chat(client, model, messages=[*messages, {"role": "user", "content": "And the time in UTC?"}],
              tool_choice="required", parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message.tool_calls)


class Weather(BaseModel):
    """Report the weather."""

    city: str = Field(max_length=12)
    degrees: int


def test_parse_with_a_pydantic_tool(client, model):
    tool = openai.pydantic_function_tool(Weather)
    r = client.chat.completions.parse(model=model, messages=ASK, tools=[tool], max_tokens=60, temperature=0,
                                      tool_choice={"type": "function", "function": {"name": "Weather"}})
    (call,) = r.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Weather), call


@pytest.mark.parametrize("kwargs, status, field", [
    ({"tool_choice": {"type": "function", "function": {"name": "not_a_tool"}}}, 400, "tool_choice.function.name"),
    ({"tools": openai.NOT_GIVEN, "tool_choice": "required"}, 400, "tool_choice"),
    ({"tools": [{"type": "web_search"}]}, 422, "tools.0"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "[unclosed"}}}}}]}, 422,
     "tools[0].function.parameters"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, 400, "tool_choice"),
])
def test_refusals_name_the_field(client, model, kwargs, status, field):
    with pytest.raises(openai.APIStatusError) as error:
        chat(client, model, **kwargs)
    assert error.value.status_code == status
    assert field in error.value.response.json()["error"]["message"], error.value.response.text
