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
import openai  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

pytestmark = pytest.mark.vllm

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(base_url=f"{app.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client):
    (card,) = client.models.list().data
    return card.id


def check_call(name: str, arguments: str, tools=TOOLS) -> tuple[str, dict]:
    """``name`` is one of ``tools`` and ``arguments`` (a JSON string) satisfy that tool's parameters."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert name in schemas, name
    value = json.loads(arguments)
    jsonschema.validate(value, schemas[name])
    return name, value


def check_calls(calls, tools=TOOLS) -> list[tuple[str, dict]]:
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_"), call
        out.append(check_call(call.function.name, call.function.arguments, tools))
    return out


def _chat(client, model, **kwargs):
    kwargs.setdefault("messages", ASK)
    kwargs.setdefault("tools", TOOLS)
    kwargs.setdefault("max_tokens", 80)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=model, **kwargs)


def test_named_tool_is_exactly_one_call_of_it(client, model):
    r = _chat(client, model, tool_choice={"type": "function", "function": {"name": "get_time"}}, n=2,
              temperature=1.0, seed=3)
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        (call,) = check_calls(choice.message.tool_calls)
        assert call[0] == "get_time"


def test_required_is_one_call_or_more(client, model):
    one = _chat(client, model, tool_choice="required", parallel_tool_calls=False)
    (choice,) = one.choices
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    check_calls(choice.message.tool_calls)
    several = _chat(client, model, tool_choice="required", max_tokens=160, n=2, temperature=1.0, seed=11)
    for choice in several.choices:
        if choice.finish_reason == "length":  # several calls may not end within max_tokens: then no call at all
            assert not choice.message.tool_calls
            continue
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) >= 1, choice
        check_calls(choice.message.tool_calls)
    assert any(c.finish_reason == "tool_calls" for c in several.choices)


def test_streamed_calls_reassemble(client, model):
    stream = _chat(client, model, tool_choice="required", parallel_tool_calls=False, stream=True)
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
