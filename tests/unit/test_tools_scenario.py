"""The ``tools`` scenario kind (a stored tool set) without the service: its validation and refusals (the same as
for a request's own ``tools``), its compile (the constraint ``tool_setup`` builds, and the plan and prompt tools
carried by the compiled version), the prompt, and the OpenAI answers read with the plan the replica's response
carries (``GenerateResponse.tool_plan``), streamed or not.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from config import Limits, ScenarioError, scenario_to_dict
from processors.kinds.tools.spec import ToolsScenario
from processors.scenarios import load_scenario, parse_scenario
from deployments.openai.api import ChatCompletionRequest, openai_response, openai_stream_chunks, openai_to_generate
from deployments.protocol import ServiceError
from deployments.openai.tool_calls import stored_plan, tool_setup
from processors import ScenarioCompiler, build_prompt_ids, compile_scenario

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"], "additionalProperties": False}}}
NOARGS = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, NOARGS]


def body(**kwargs):
    return {"type": "tools", "tools": TOOLS, **kwargs}


# --------------------------------------------------------------------------------------------- validation


def test_a_tool_set_validates_and_stores_as_given():
    scenario = parse_scenario(body(tool_choice="required", parallel_tool_calls=False, max_new_tokens=40), Limits())
    assert isinstance(scenario, ToolsScenario)
    assert scenario_to_dict(scenario) == body(tool_choice="required", parallel_tool_calls=False, max_new_tokens=40)
    assert load_scenario(body()).tool_choice == "auto"  # the default, as for a request with tools


@pytest.mark.parametrize("bad, kind, starts", [
    (body(tools=[WEATHER, WEATHER]), "invalid", "tools: function names must be distinct"),
    (body(tool_choice={"type": "function", "function": {"name": "other"}}), "invalid",
     "tool_choice.function.name: 'other' is not one of the tools"),
    (body(tool_choice="none"), "invalid", "tool_choice: 'none' is not a stored default"),
    (body(tool_choice="sometimes"), "invalid", "tool_choice: 'sometimes' is not one of"),
    (body(tool_choice={"type": "function"}), "invalid", "tool_choice.function: Field required"),
    (body(tools=[]), "invalid", "tools: List should have at least 1 item"),
    (body(tools=[{"type": "function", "function": {"name": "a b"}}]), "invalid", "tools[0].function.name:"),
    (body(tools=[{"type": "code_interpreter"}]), "invalid", "tools[0].type:"),
    (body(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]), "invalid",
     "tools[0].function.parameters: the arguments' schema must describe an object"),
    (body(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}]), "invalid",
     "tools[0].function.parameters: schema: invalid JSON Schema"),
    (body(parallel_tool_calls=1), "invalid", "parallel_tool_calls:"),
    (body(extra=1), "invalid", "extra:"),
])
def test_refusals_name_the_field(bad, kind, starts):
    with pytest.raises(ScenarioError) as error:
        parse_scenario(bad, Limits())
    assert error.value.kind == kind and error.value.message.startswith(starts), error.value.message


def test_parameters_past_the_json_schema_limits_are_refused_naming_the_tool():
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(ScenarioError) as error:
        parse_scenario(body(tools=[WEATHER, {"type": "function", "function": {"name": "f", "parameters": deep}}]),
                       Limits())
    assert error.value.kind == "limit" and error.value.field == "tools[1].function.parameters", error.value.message
    # each tool within max_schema_bytes, the call schema they make together is not
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(30)}}
    size = len(json.dumps(big, separators=(",", ":")))
    many = [{"type": "function", "function": {"name": f"f{i}", "parameters": big}} for i in range(3)]
    with pytest.raises(ScenarioError) as error:
        parse_scenario(body(tools=many), Limits(max_schema_bytes=size + 10))
    assert error.value.kind == "limit" and error.value.field == "tools", error.value.message
    parse_scenario(body(tools=many[:1]), Limits(max_schema_bytes=size * 2))


# --------------------------------------------------------------------------------------------- compile


@pytest.mark.parametrize("choice, parallel", [
    ("auto", None), ("required", False), ("required", True), ({"type": "function", "function": {"name": "ping"}}, None),
])
def test_compile_is_the_constraint_tool_setup_builds(tok, choice, parallel):
    compiled = compile_scenario(load_scenario(body(tool_choice=choice, parallel_tool_calls=parallel)), tok)
    plan, prompt_tools = tool_setup(TOOLS, choice, parallel, Limits())
    one_off = compile_scenario(load_scenario(plan.scenario), tok)
    assert compiled.kind == "tools" and compiled.constraint.version == one_off.constraint.version
    assert json.loads(compiled.constraint.schema) == plan.scenario["schema"]
    assert compiled.extras == {"mode": plan.mode, "names": list(plan.names), "parallel": plan.parallel,
                              "prompt_tools": prompt_tools}
    assert compiled.version != one_off.version  # the tools are part of the version


def test_versions_follow_the_tools_and_the_choice(tok):
    def version(**kwargs):
        return compile_scenario(load_scenario(body(**kwargs)), tok).version

    assert version() == version()
    assert len({version(), version(tool_choice="required"), version(tools=[WEATHER]),
                version(tools=[WEATHER, {"type": "function", "function": {"name": "ping", "description": "x"}}])}) == 4


def test_the_pipeline_compiles_it_and_the_prompt_shows_the_stored_tools(tokenizer):
    compiler = ScenarioCompiler(tokenizer, Limits(), grammar_worker=None)
    compiled = compiler.prepare_now(body(tool_choice="required", system_prompt="Be brief."))
    messages = [{"role": "user", "content": "weather in Paris?"}]
    stored = build_prompt_ids(compiled, tokenizer, messages=messages)
    plain = compiler.prepare_now({"type": "json", "system_prompt": "Be brief."})
    assert stored == build_prompt_ids(plain, tokenizer, messages=messages, tools=compiled.extras["prompt_tools"])
    assert stored != build_prompt_ids(plain, tokenizer, messages=messages)
    assert "get_weather" in tokenizer.decode(stored)


# --------------------------------------------------------------------------------------------- the OpenAI answers


def _response(text: str, plan: dict | None, version: int = 2) -> dict:
    return {"scenario": "agent", "version": version, "tool_plan": plan,
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            "outputs": [{"text": text, "token_ids": [1], "finish_reason": "stop"}]}


PLAN = {"mode": "required", "names": ["get_weather", "ping"], "parallel": True}


def test_an_answer_is_read_with_the_plan_it_carries():
    answer = openai_response(_response('[{"name": "ping", "arguments": {}}]', PLAN), chat=True, model="m")
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "ping", "arguments": "{}"}
    assert (answer["scenario"], answer["scenario_version"]) == ("agent", 2)
    # a name outside the version's tools is not a call (the plan of another version is never used)
    other = openai_response(_response('{"name": "get_time", "arguments": {}}', {**PLAN, "names": ["get_time"]}),
                            chat=True, model="m")
    assert other["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time"
    text = openai_response(_response('{"name": "ping", "arguments": {}}', PLAN), chat=False, model="m")
    assert text["choices"][0]["text"] == '{"name": "ping", "arguments": {}}'  # completions: the raw text
    assert stored_plan(None) is None and stored_plan(PLAN).names == ("get_weather", "ping")


def test_a_think_tool_set_reads_the_calls_after_the_thinking():
    response = _response('<think>\nhmm</think>\n\n{"name": "ping", "arguments": {}}', PLAN)
    response["outputs"][0].update(reasoning_content="hmm", answer='{"name": "ping", "arguments": {}}')
    (choice,) = openai_response(response, chat=True, model="m")["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == "hmm"
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "ping"

    async def events():
        yield {"type": "done", "index": 0, "response": response}

    async def collect():
        return [c async for c in openai_stream_chunks(events(), model="m", chat=True, n=1, include_usage=False)]

    deltas = [c["choices"][0]["delta"] for c in asyncio.run(collect())]
    assert deltas[1] == {"reasoning_content": "hmm"} and deltas[2]["tool_calls"][0]["function"]["name"] == "ping"


def test_a_stream_holds_the_marked_tokens_and_sends_the_calls():
    async def events():
        yield {"type": "token", "index": 0, "token_id": 1, "text": '{"name"', "tool_call": True}
        yield {"type": "token", "index": 0, "token_id": None, "text": ': "ping", "arguments": {}}', "tool_call": True,
               "finish_reason": "stop"}
        yield {"type": "done", "index": 0, "response": _response('{"name": "ping", "arguments": {}}',
                                                                 {**PLAN, "parallel": False})}

    async def collect():
        return [c async for c in openai_stream_chunks(events(), model="m", chat=True, n=1, include_usage=False)]

    chunks = asyncio.run(collect())
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert not any(d.get("content") for d in deltas), deltas
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"]["name"] == "ping" and "".join(c["function"]["arguments"] for c in calls) == "{}"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("extra, field", [
    ({"tool_choice": "none"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "ping"}}}, "tool_choice"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"tools": [WEATHER]}, "tool_choice"),  # tools with a stored scenario: decoded under which constraint?
])
def test_a_request_naming_a_scenario_does_not_choose_its_tools(extra, field):
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                    "scenario": "agent", **extra})
    with pytest.raises(ServiceError) as error:
        openai_to_generate(request, Limits())
    assert error.value.status == 400 and error.value.message.startswith(field), error.value.message
    plain, _ = openai_to_generate(ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "scenario": "agent"}), Limits())
    assert plain.scenario == "agent" and plain.tools is None and plain.inline_scenario is None
