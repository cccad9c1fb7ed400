"""Tool calls without the service: the one-off constraint built from ``tools`` + ``tool_choice`` +
``parallel_tool_calls`` (``deployments/openai/tool_calls.py``), its refusals, reading a finished output as calls, the
stream deltas, and the prompt (``processors/tool_prompt.py``) for a template with and without tools support.

The constraint is compiled for the default model's tokenizer (llguidance must accept the call schema)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import BaseModel

from config import Limits
from deployments.openai.api import ChatCompletionRequest, openai_response, openai_to_generate
from deployments.protocol import ServiceError
from deployments.openai.tool_calls import parse_tool_output, tool_call_deltas, tool_setup
from processors import ScenarioCompiler, build_prompt_ids
from processors.tool_prompt import render_tools


class Address(BaseModel):
    city: str
    zip: str


class Person(BaseModel):
    name: str
    home: Address


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"], "additionalProperties": False}}}
PERSON = {"type": "function", "function": {"name": "save_person", "parameters": Person.model_json_schema()}}
NOARGS = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, PERSON, NOARGS]


def chat(**kwargs):
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kwargs})


@pytest.mark.parametrize("choice, parallel, good, bad", [
    ("required", False, {"name": "get_weather", "arguments": {"city": "Paris"}},
     [{"name": "nope", "arguments": {}}, "text", [{"name": "ping", "arguments": {}}]]),
    ("required", None, [{"name": "ping", "arguments": {}},
                        {"name": "save_person", "arguments": {"name": "A", "home": {"city": "B", "zip": "1"}}}],
     [[], {"name": "ping", "arguments": {}}, [{"name": "save_person", "arguments": {"name": "A", "home": {}}}]]),
    ({"type": "function", "function": {"name": "save_person"}}, None,
     {"name": "save_person", "arguments": {"name": "A", "home": {"city": "B", "zip": "1"}}},
     [{"name": "get_weather", "arguments": {"city": "x"}}, [{"name": "save_person", "arguments": {}}]]),
    ("auto", False, "just text", [{"name": "ping", "arguments": {"x": 1}}, 3]),
    ("auto", True, [{"name": "ping", "arguments": {}}], [{"name": "get_weather", "arguments": {}}]),
])
def test_the_call_schema_takes_exactly_the_calls_asked_for(choice, parallel, good, bad, tokenizer):
    plan, prompt_tools = tool_setup(TOOLS, choice, parallel, Limits())
    schema = plan.scenario["schema"]
    jsonschema.validate(good, schema)
    for value in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)
    assert [t["function"]["name"] for t in prompt_tools] == ["get_weather", "save_person", "ping"]
    compiled = ScenarioCompiler(tokenizer, Limits()).prepare_now(plan.scenario)  # llguidance takes it
    assert compiled.constraint.output_error(json.dumps(good)) is None


def test_call_arguments_hold_only_the_declared_keys(tokenizer):
    """A tool whose ``parameters`` set no ``additionalProperties`` (smolagents' ``@tool``, most clients): its calls'
    arguments carry only the keys it declares, as OpenAI's and xgrammar's (vLLM's) calls do; the check of a
    finished call stays the schema as written."""
    import llguidance

    from processors.tokenizer_info import TokenizerInfo

    params = {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
              "required": ["city"]}
    plan, _ = tool_setup([{"type": "function", "function": {"name": "get_weather", "parameters": params}}],
                         "required", False, Limits())
    spec = ScenarioCompiler(tokenizer, Limits()).prepare_now(plan.scenario).constraint

    def accepts(text):
        matcher = llguidance.LLMatcher(TokenizerInfo.of(tokenizer).lltokenizer, spec.grammar, log_level=0)
        return all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) \
            and matcher.is_accepting()

    assert accepts('{"name":"get_weather","arguments":{"city":"Paris"}}')
    for extra in ('{"name":"get_weather","arguments":{"city":"Paris","description":"x"}}',
                  '{"name":"get_weather","arguments":{"city":"Paris","":"x"}}'):
        assert not accepts(extra), extra
        assert spec.output_error(extra) is None  # the schema as written allows the key
    assert spec.exact  # every call the grammar completes is valid


def test_none_and_no_tools_leave_the_output_alone():
    assert tool_setup(TOOLS, "none")[0] is None and tool_setup(TOOLS, "none")[1]
    assert tool_setup(None, None) == (None, None)
    assert tool_setup([], "none") == (None, None)
    request, _ = openai_to_generate(chat(tools=[WEATHER], tool_choice="none", response_format={"type": "json_object"}))
    assert request.inline_scenario["schema"] == {"type": "object"} and request.tools == [
        {"type": "function", "function": {k: v for k, v in WEATHER["function"].items()}}]


@pytest.mark.parametrize("body, status, field", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, 400,
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, 400, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, 400, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "("}}}}}]}, 422, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, 422,
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, 400, "tool_choice"),
    ({"tools": [WEATHER], "scenario": "sentiment", "tool_choice": "required"}, 400, "tool_choice"),
])
def test_refusals_name_the_field(body, status, field):
    with pytest.raises(ServiceError) as error:
        openai_to_generate(chat(**body), Limits())
    assert error.value.status == status and error.value.message.startswith(field), error.value.message


def test_a_schema_past_the_limits_is_refused_naming_the_tool():
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(ServiceError) as error:
        tool_setup([{"type": "function", "function": {"name": "f", "parameters": deep}}], "auto", None, Limits())
    assert error.value.status == 422 and error.value.message.startswith("tools[0].function.parameters")


@pytest.mark.parametrize("choice", [{"type": "code_interpreter"}, {"type": "function"}])
def test_non_function_tools_are_refused(choice):
    with pytest.raises(Exception) as error:
        chat(tools=[choice])
    assert "tools.0" in str(error.value)


def test_outputs_read_as_calls_and_text():
    plan, _ = tool_setup(TOOLS, "auto", None, Limits())
    content, calls, reason = parse_tool_output('[{"name": "get_weather", "arguments": {"city": "Paris"}}]', "stop", plan)
    assert content is None and reason == "tool_calls" and len(calls) == 1
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert parse_tool_output('"hello"', "stop", plan) == ("hello", None, "stop")
    assert parse_tool_output('[{"name": "get_wea', "length", plan) == ('[{"name": "get_wea', None, "length")
    assert parse_tool_output("x", "stop", None) == ("x", None, "stop")
    response = openai_response({"scenario": None, "version": None, "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                                                              "total_tokens": 2},
                                "outputs": [{"text": '{"name": "ping", "arguments": {}}', "token_ids": [1],
                                             "finish_reason": "stop"}]}, chat=True, model="m", tools=plan)
    choice = response["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "ping", "arguments": "{}"}


def test_stream_deltas_reassemble_to_the_calls():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"a": "x" * 70})}},
             {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]
    deltas = tool_call_deltas(calls, piece=16)
    assert deltas[0] == {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                         "function": {"name": "f", "arguments": ""}}]}
    rebuilt: dict[int, str] = {}
    for delta in deltas:
        (part,) = delta["tool_calls"]
        rebuilt[part["index"]] = rebuilt.get(part["index"], "") + part["function"]["arguments"]
    assert rebuilt == {0: calls[0]["function"]["arguments"], 1: "{}"}


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"},
]


def test_prompt_without_template_tools_support(tokenizer):
    msgs, template_tools = render_tools(CONVERSATION, [WEATHER], tokenizer)
    assert template_tools is None and [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert '"name": "get_weather"' in msgs[0]["content"] and msgs[2]["content"] == (
        '{"name": "get_weather", "arguments": {"city": "Paris"}}')
    assert msgs[3]["content"] == "<tool_response>\nsunny, 21 C\n</tool_response>"
    ids = build_prompt_ids(None, tokenizer, messages=CONVERSATION, tools=[WEATHER])
    text = tokenizer.decode(ids)
    assert "get_weather" in text and "sunny, 21 C" in text and "Weather in a city" in text
    # no tools, no tool turns: the prompt is what it was
    plain = [{"role": "user", "content": "hi"}]
    assert build_prompt_ids(None, tokenizer, messages=plain) == build_prompt_ids(None, tokenizer, messages=plain,
                                                                                 tools=None)


class ToolsTemplate:
    chat_template = "{% for t in tools %}{{ t.function.name }};{% endfor %}{% for m in messages %}{{ m.role }}{% endfor %}"


def test_prompt_with_a_template_that_takes_tools():
    msgs, template_tools = render_tools(CONVERSATION, [WEATHER], ToolsTemplate())
    assert template_tools == [WEATHER] and [m["role"] for m in msgs] == ["user", "assistant", "tool"]
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # an object, as templates expect
