"""Stored tool sets (a ``tools`` scenario) against the shared app, with real HTTP and the real ``openai`` client.

A tool set is PUT once and named by ``scenario``: chat completions (plain and streamed) and the Responses API
answer with calls of its functions, each checked here with ``jsonschema`` against the stored ``parameters``;
``/v1/generate`` answers with the raw call text. A new version with another function is used by the next request
(hot swap) and the answer names that version; a request admitted before the swap keeps the tools of the version
it was admitted with. And the refusals (each names its field).
"""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest
import requests

from tool_checks import ASK, TIME, WEATHER, check_calls, openai_model

pytestmark = pytest.mark.serve

# a long required argument: a request of this version decodes long enough for a PUT to land while it runs
NOTE = {"type": "function", "function": {
    "name": "write_note", "description": "Write a note.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string", "minLength": 120, "maxLength": 140}},
                   "required": ["text"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def model(client):
    return openai_model(client)


def call_names(calls, tools) -> list[str]:
    """The names of ``calls``, each checked against the stored ``tools`` (tool_checks.check_calls)."""
    return [name for name, _ in check_calls(calls, tools)]


def _chat(client, model, name, **kwargs):
    kwargs.setdefault("messages", ASK)
    kwargs.setdefault("max_tokens", 80)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=model, extra_body={"scenario": name}, **kwargs)


def test_a_stored_tool_set_answers_with_calls(client, model, serve_app):
    put = serve_app.put("t-tools", {"type": "tools", "tools": [WEATHER, TIME], "tool_choice": "required",
                                    "parallel_tool_calls": False, "max_new_tokens": 80})
    version = put["version"]
    r = _chat(client, model, "t-tools", n=2, temperature=1.0, seed=5)
    assert (r.scenario, r.scenario_version) == ("t-tools", version)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        assert len(call_names(choice.message.tool_calls, [WEATHER, TIME])) == 1  # parallel_tool_calls false
    # streamed: the calls come as deltas, reassembled here
    parts: dict[int, dict] = {}
    finish = None
    for chunk in _chat(client, model, "t-tools", stream=True):
        (choice,) = chunk.choices
        assert not choice.delta.content, chunk  # no call text leaks as content
        for delta in choice.delta.tool_calls or []:
            part = parts.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            part["id"] = delta.id or part["id"]
            part["name"] += (delta.function.name or "") if delta.function else ""
            part["arguments"] += (delta.function.arguments or "") if delta.function else ""
        finish = choice.finish_reason or finish
    assert finish == "tool_calls" and len(parts) == 1, parts
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for part in parts.values():
        assert part["id"].startswith("call_") and part["name"] in schemas
        jsonschema.validate(json.loads(part["arguments"]), schemas[part["name"]])


def test_the_responses_api_and_the_native_route(client, model, serve_app):
    serve_app.put("t-tools-resp", {"type": "tools", "tools": [WEATHER],
                                   "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    r = client.responses.create(model=model, input="Weather in Oslo?", temperature=0, max_output_tokens=60,
                                extra_body={"scenario": "t-tools-resp"})
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and r.scenario == "t-tools-resp", r
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    kinds = []
    with client.responses.stream(model=model, input="Weather in Rome?", temperature=0, max_output_tokens=60,
                                 extra_body={"scenario": "t-tools-resp"}) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_response()
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_weather", final
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    # /v1/generate: the raw text of the call (a json_schema-like constraint)
    native = serve_app.generate({"scenario": "t-tools-resp", "messages": ASK, "temperature": 0,
                                 "max_new_tokens": 60})
    assert native.status_code == 200, native.text
    (out,) = native.json()["outputs"]
    value = json.loads(out["text"])
    assert out["finish_reason"] == "stop" and value["name"] == "get_weather", out
    jsonschema.validate(value["arguments"], WEATHER["function"]["parameters"])


def test_a_new_version_is_used_by_the_next_request(client, model, serve_app):
    first = serve_app.put("t-tools-swap", {"type": "tools", "tools": [WEATHER], "tool_choice": "required",
                                           "parallel_tool_calls": False})["version"]
    r = _chat(client, model, "t-tools-swap")
    assert call_names(r.choices[0].message.tool_calls, [WEATHER]) == ["get_weather"]
    assert r.scenario_version == first
    second = serve_app.put("t-tools-swap", {"type": "tools", "tools": [TIME],
                                            "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert second["version"] == first + 1
    r = _chat(client, model, "t-tools-swap")
    assert call_names(r.choices[0].message.tool_calls, [TIME]) == ["get_time"]
    assert (r.scenario, r.scenario_version) == ("t-tools-swap", first + 1)


def test_a_request_keeps_the_tools_of_the_version_it_was_admitted_with(model, serve_app):
    old = serve_app.put("t-tools-pin", {"type": "tools", "tools": [NOTE], "tool_choice": "required",
                                        "parallel_tool_calls": False, "max_new_tokens": 200})["version"]
    body = {"model": model, "messages": [{"role": "user", "content": "Write a note."}], "temperature": 0,
            "stream": True, "scenario": "t-tools-pin"}
    lines: list[str] = []
    with requests.post(f"{serve_app.url}/v1/chat/completions", json=body, stream=True, timeout=180) as response:
        assert response.status_code == 200, response.text
        it = response.iter_lines(decode_unicode=True)
        lines.append(next(it))  # the role chunk comes once a replica admitted (and pinned) the request
        swap = threading.Thread(target=serve_app.put, args=("t-tools-pin", {
            "type": "tools", "tools": [TIME], "tool_choice": "required", "parallel_tool_calls": False}))
        swap.start()
        lines.extend(it)
        swap.join(timeout=120)
    chunks = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]
    calls = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls") or []] if chunks else []
    names = {d["function"]["name"] for d in calls if d.get("function", {}).get("name")}
    arguments = "".join(d["function"].get("arguments") or "" for d in calls)
    assert names == {"write_note"}, chunks  # the admitted version's tools, whenever the swap landed
    jsonschema.validate(json.loads(arguments), NOTE["function"]["parameters"])
    r = requests.post(f"{serve_app.url}/v1/chat/completions", timeout=180, json={
        "model": model, "messages": ASK, "temperature": 0, "max_tokens": 60, "scenario": "t-tools-pin"}).json()
    assert r["scenario_version"] == old + 1 and r["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == \
        "get_time", r


@pytest.mark.parametrize("extra, status, field", [
    ({"tools": [WEATHER], "tool_choice": "none"}, 400, "tools"),  # the request's own tools with a stored tool set
    ({"tools": [WEATHER]}, 400, "tool_choice"),
    ({"tool_choice": "none"}, 400, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, 400, "tool_choice"),
    ({"parallel_tool_calls": True}, 400, "parallel_tool_calls"),
])
def test_refusals_name_the_field(model, serve_app, extra, status, field):
    serve_app.put("t-tools-refuse", {"type": "tools", "tools": [WEATHER, TIME]})
    r = requests.post(f"{serve_app.url}/v1/chat/completions", timeout=180, json={
        "model": model, "messages": ASK, "max_tokens": 20, "scenario": "t-tools-refuse", **extra})
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"].startswith(field), r.text


@pytest.mark.parametrize("body, status, field", [
    ({"type": "tools", "tools": [WEATHER, WEATHER]}, 422, "tools: function names must be distinct"),
    ({"type": "tools", "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     422, "tool_choice.function.name: 'get_time' is not one of the tools"),
    ({"type": "tools", "tools": [WEATHER], "tool_choice": "none"}, 422, "tool_choice: 'none'"),
    ({"type": "tools", "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     422, "tools[0].function.parameters: the arguments' schema must describe an object"),
])
def test_a_bad_tool_set_is_refused_at_put(serve_app, body, status, field):
    r = requests.put(f"{serve_app.url}/admin/scenarios/t-tools-bad", json=body, headers=serve_app.admin, timeout=120)
    assert r.status_code == status and field in r.text, r.text
