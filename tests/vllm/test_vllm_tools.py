"""Tool calls and the Responses API with ``engine: vllm``, over real HTTP with the real ``openai`` client.

The same app as test_vllm_serve.py (conftest.py's ``app``: one vLLM-backed model replica). On
``POST /v1/chat/completions``: a forced named tool, ``tool_choice: "required"``, streamed tool-call deltas
reassembled; on ``POST /v1/responses``: ``responses.parse(text_format=...)`` and ``responses.create`` with a function
tool. Every call is checked with ``jsonschema``: its name is one of the request's tools, its arguments satisfy that
tool's ``parameters``.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm.v1.engine.async_llm", reason="the vLLM tier runs in .venv-vllm: bash scripts/test_vllm.sh")

import jsonschema  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from tool_checks import TOOLS, chat, check_call, check_calls, openai_model  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model(client):
    return openai_model(client)


def test_named_tool_is_exactly_one_call_of_it(client, model):
    r = chat(client, model, tool_choice={"type": "function", "function": {"name": "get_time"}}, n=2,
              temperature=1.0, seed=3)
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        (call,) = check_calls(choice.message.tool_calls)
        assert call[0] == "get_time"


def test_required_is_one_call_or_more(client, model):
    one = chat(client, model, tool_choice="required", parallel_tool_calls=False)
    (choice,) = one.choices
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    check_calls(choice.message.tool_calls)
    several = chat(client, model, tool_choice="required", max_tokens=160, n=2, temperature=1.0, seed=11)
    for choice in several.choices:
        if choice.finish_reason == "length":  # several calls may not end within max_tokens: then no call at all
            assert not choice.message.tool_calls
            continue
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) >= 1, choice
        check_calls(choice.message.tool_calls)
    assert any(c.finish_reason == "tool_calls" for c in several.choices)


def test_streamed_calls_reassemble(client, model):
    stream = chat(client, model, tool_choice="required", parallel_tool_calls=False, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            assert not choice.delta.content
            for part in choice.delta.tool_calls or []:
                if part.index not in calls:  # the first delta of a call: id, type, name
                    assert part.id.startswith("call_") and part.type == "function" and part.function.name
                    calls[part.index] = {"name": part.function.name, "arguments": ""}
                else:
                    assert part.id is None
                calls[part.index]["arguments"] += part.function.arguments or ""
    assert finish == "tool_calls" and len(calls) == 1, (finish, calls)
    for call in calls.values():
        check_call(call["name"], call["arguments"])


class Car(BaseModel):
    brand: str = Field(max_length=16)
    model: str = Field(max_length=16)


def test_responses_parse_with_a_pydantic_model(client, model):
    r = client.responses.parse(model=model, input="Describe a car as JSON.", text_format=Car, temperature=0,
                               max_output_tokens=60)
    assert r.status == "completed", r
    assert isinstance(r.output_parsed, Car), r
    jsonschema.validate(json.loads(r.output_text), Car.model_json_schema())
    assert r.text.format.type == "json_schema" and r.text.format.name == "Car"


def test_responses_create_with_a_function_tool(client, model):
    tools = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
              "parameters": t["function"]["parameters"], "strict": True} for t in TOOLS]
    r = client.responses.create(model=model, input="What is the weather in Paris?", tools=tools,
                                tool_choice="required", parallel_tool_calls=False, temperature=0,
                                max_output_tokens=80)
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1, r.model_dump_json()
    for call in calls:
        assert call.id.startswith("fc_") and call.call_id.startswith("call_"), call
        check_call(call.name, call.arguments)
    named = client.responses.create(model=model, input="Time in Berlin?", tools=tools, temperature=0,
                                    tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=40)
    (call,) = named.output
    assert call.type == "function_call" and call.name == "get_time", named.model_dump_json()
    check_call(call.name, call.arguments)
