"""The bounds on tools, in-process: ``tool_setup`` counts the tools first
(``limits.max_tools``) and measures their ``parameters`` before reading any, its work after is linear, every check
applies whatever ``tool_choice`` is; a stored tool set gets the same bound; an earlier call's ``arguments`` are held
to ``max_json_depth`` (a 422 naming the field, never a ``RecursionError``). HTTP: tests/security/test_tool_bounds_http.py.
"""

from __future__ import annotations

import json
import time

import pytest

from config import Limits, ScenarioError
from processors.scenarios import parse_scenario
from deployments.openai.api import ChatCompletionRequest, openai_to_generate
from deployments.protocol import ServiceError
from deployments.openai.responses import ResponsesRequest, responses_to_chat
from deployments.openai.tool_calls import check_arguments, check_tool_fields, tool_setup
from processors.tool_prompt import render_tools

DEFAULTS = Limits()


def _tools(count: int, parameters: dict | None = None) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}", **({"parameters": parameters} if parameters else {})}}
            for i in range(count)]


def _deep_schema(steps: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(steps - 1):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("choice", [None, "none", "auto", "required", {"type": "function", "function": {"name": "f0"}}])
def test_more_tools_than_max_tools_are_refused_before_any_is_read(choice):
    tools = _tools(DEFAULTS.max_tools + 1)
    tools[-1] = {"type": "no such tool"}  # never read: the count comes first
    with pytest.raises(ServiceError) as error:
        tool_setup(tools, choice, None, DEFAULTS)
    assert error.value.status == 422, error.value.message
    assert error.value.message == (f"tools: {DEFAULTS.max_tools + 1} tools exceeds the limit "
                                   f"max_tools={DEFAULTS.max_tools}")
    assert error.value.detail == {"field": "tools", "limit_name": "max_tools", "limit": DEFAULTS.max_tools}
    plan, prompt = tool_setup(_tools(DEFAULTS.max_tools), choice, None, DEFAULTS)  # at the limit: taken
    assert len(prompt) == DEFAULTS.max_tools and (plan is None) == (choice == "none")


def test_six_thousand_tools_are_refused_at_once():
    """6,000 parameterless tools: refused by the count (they took 75 s through the quadratic setup)."""
    start = time.monotonic()
    with pytest.raises(ServiceError, match="max_tools"):
        tool_setup(_tools(6000), "auto", None, DEFAULTS)
    assert time.monotonic() - start < 1.0


def test_the_setup_is_linear_in_the_tools():
    """3,000 tools under a limit that allows them: the setup compares no tools with each other and checks no
    schema twice (it was 35 s: pydantic comparisons of every pair, and the whole call schema checked again
    against the JSON-schema meta-schema). A generous bound: it takes well under a second here."""
    limits = Limits(max_tools=3000, max_schema_bytes=8 * 1024 * 1024)
    start = time.monotonic()
    plan, prompt = tool_setup(_tools(3000), "required", None, limits)
    assert time.monotonic() - start < 5.0
    assert len(plan.names) == 3000 and len(prompt) == 3000
    assert len(plan.scenario["schema"]["items"]["anyOf"]) == 3000


@pytest.mark.parametrize("choice", ["none", "auto", "required"])
def test_the_parameters_checks_apply_whatever_the_tool_choice(choice):
    field = "tools[0].function.parameters"
    cases = [
        (_deep_schema(DEFAULTS.max_schema_depth // 2 + 1), "max_schema_depth"),
        ({"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100} for i in range(4000)}},
         "max_schema_bytes"),
        ({"type": "object", "properties": {"a": {"type": "string", "pattern": "a{1000000}"}}}, "max_regex_repeat"),
        ({"type": "object", "properties": {"a": {"type": "no-such-type"}}}, "invalid JSON Schema"),
        ({"type": "string"}, "must describe an object"),
    ]
    for parameters, words in cases:
        with pytest.raises(ServiceError) as error:
            tool_setup(_tools(1, parameters), choice, None, DEFAULTS)
        assert error.value.status == 422 and error.value.message.startswith(field), error.value.message
        assert words in error.value.message, error.value.message


def test_the_parameters_together_are_held_to_max_schema_bytes():
    """Each tool within max_schema_bytes, all of them together not: refused (naming ``tools``) before any schema is
    checked against the meta-schema, whatever the choice (the call schema holds only a named tool's)."""
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(30)}}
    size = len(json.dumps(big, separators=(",", ":")))
    limits = Limits(max_schema_bytes=size * 2 + 10)
    tools = _tools(3, big)
    tools[2]["function"]["parameters"] = {**big, "properties": {**big["properties"], "bad": {"type": "nope"}}}
    for choice in ("none", {"type": "function", "function": {"name": "f0"}}):
        with pytest.raises(ServiceError) as error:
            tool_setup(tools, choice, None, limits)
        assert error.value.message.startswith("tools: ") and f"max_schema_bytes={limits.max_schema_bytes}" in \
            error.value.message, error.value.message
    tool_setup(tools[:2], "none", None, limits)


def test_a_stored_tool_set_is_held_to_max_tools_before_it_is_read():
    body = {"type": "tools", "tools": _tools(DEFAULTS.max_tools + 1)}
    body["tools"][-1] = {"not": "a tool"}
    with pytest.raises(ScenarioError) as error:
        parse_scenario(body, DEFAULTS)
    assert error.value.kind == "limit" and error.value.field == "tools", error.value.message
    assert f"max_tools={DEFAULTS.max_tools}" in error.value.message
    scenario = parse_scenario({"type": "tools", "tools": _tools(DEFAULTS.max_tools)}, DEFAULTS)
    assert scenario.plan() is scenario.plan()  # built once, at validation: the compile takes the same


DEEP_TEXT = "[" * 3000 + "]" * 3000  # arguments deeper than Python's JSON parser goes


@pytest.mark.parametrize("arguments", [DEEP_TEXT, "[" * 65 + "]" * 65, '{"a":' * 70 + "1" + "}" * 70,
                                       json.loads("[" * 65 + "]" * 65)])
def test_call_arguments_past_max_json_depth_are_a_422_naming_them(arguments):
    with pytest.raises(ServiceError) as error:
        check_arguments(arguments, "messages[1].tool_calls[0].function.arguments", DEFAULTS)
    assert error.value.status == 422
    assert error.value.message == (f"messages[1].tool_calls[0].function.arguments: nesting depth over "
                                   f"{DEFAULTS.max_json_depth} exceeds the limit max_json_depth={DEFAULTS.max_json_depth}")


@pytest.mark.parametrize("arguments", ["[" * 64 + "]" * 64, '{"city": "Paris"}', "not json [[[", "", None, 3])
def test_call_arguments_within_the_limit_or_not_json_pass(arguments):
    check_arguments(arguments, "arguments", DEFAULTS)


def _history(arguments) -> list[dict]:
    return [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"}]


def test_the_routes_name_the_arguments_field():
    """Chat: the ingress's check of the request (check_tool_fields) names messages[i]...; the Responses mapping
    names input[i].arguments."""
    request, _ = openai_to_generate(ChatCompletionRequest.model_validate({"messages": _history(DEEP_TEXT)}), DEFAULTS)
    with pytest.raises(ServiceError, match=r"^messages\[1\]\.tool_calls\[0\]\.function\.arguments: nesting depth"):
        check_tool_fields(DEFAULTS, request.tools, request.messages)
    body = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "Hi"}, {"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP_TEXT},
        {"type": "function_call_output", "call_id": "c1", "output": "done"}]})
    with pytest.raises(ServiceError, match=r"^input\[1\]\.arguments: nesting depth over 64"):
        responses_to_chat(body, DEFAULTS)
    # the native route's tools (for the prompt only) are held to the tool limits too
    with pytest.raises(ServiceError, match=r"^tools\[0\]\.function\.parameters: nesting depth"):
        check_tool_fields(DEFAULTS, _tools(1, _deep_schema(40)), None)
    with pytest.raises(ServiceError, match="max_tools"):
        check_tool_fields(DEFAULTS, _tools(DEFAULTS.max_tools + 1), None)


def test_the_prompt_keeps_arguments_too_deep_to_parse_as_text(tokenizer):
    """A replica called without the ingress: the arguments stay text (it raised RecursionError, a 500)."""
    messages, _ = render_tools(_history(DEEP_TEXT), None, tokenizer)
    assert any(DEEP_TEXT in (m.get("content") or "") for m in messages)
