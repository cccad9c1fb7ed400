"""A stored tool set swapped while a request decodes (the model replica and the default model, no Ray).

The request is admitted under version 1 (its first token event is out), the replica's table then serves version 2
with another function: the request still finishes under version 1, its answer carries version 1's plan
(``GenerateResponse.tool_plan``) and the OpenAI stream reads its output as a call of version 1's function, checked
with ``jsonschema``; the next request gets version 2. Deterministic, unlike a swap timed over HTTP
(``tests/serve/test_tools_scenario_http.py``).
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from config import Limits, ServerSettings
from deployments.openai.api import openai_response, openai_stream_chunks
from processors import ScenarioCompiler

NOTE = {"type": "function", "function": {
    "name": "write_note", "description": "Write a note.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string", "minLength": 40, "maxLength": 60}},
                   "required": ["text"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
                   "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def replica(model, tokenizer):
    from deployments.replica import ModelReplica

    rep = ModelReplica(ServerSettings(), None, model=model, tokenizer=tokenizer)
    yield rep
    rep.shutdown()


def _serve(replica, name: str, version: int, compiled) -> None:
    subscriber = replica.subscriber
    with subscriber._lock:  # what _apply does for a manager's snapshot
        subscriber._scenarios = {**subscriber._scenarios, name: (version, compiled)}


def test_a_request_keeps_the_tools_of_its_version_across_a_swap(replica, tokenizer):
    compiler = ScenarioCompiler(tokenizer, Limits(), grammar_worker=None)
    one = compiler.prepare_now({"type": "tools", "tools": [NOTE], "tool_choice": "required",
                                "parallel_tool_calls": False})
    two = compiler.prepare_now({"type": "tools", "tools": [TIME], "tool_choice": "required",
                                "parallel_tool_calls": False})
    _serve(replica, "agent", 1, one)
    body = {"scenario": "agent", "messages": [{"role": "user", "content": "Write a note."}], "temperature": 0,
            "max_new_tokens": 120, "stream": True}
    done: list[dict] = []

    async def run() -> list[dict]:
        stream = replica.generate_stream(body)
        first = await anext(stream)
        assert first["type"] == "token" and first["tool_call"] is True, first
        _serve(replica, "agent", 2, two)  # the swap, while the request decodes

        async def events():
            yield first
            async for event in stream:
                if event["type"] == "done":
                    done.append(event["response"])
                yield event

        return [c async for c in openai_stream_chunks(events(), model="m", chat=True, n=1, include_usage=False)]

    chunks = asyncio.run(run())
    (response,) = done
    assert response["version"] == 1 and response["tool_plan"] == {"mode": "required", "names": ["write_note"],
                                                                  "parallel": False}
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert not any(d.get("content") for d in deltas), deltas
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"]["name"] == "write_note" and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    jsonschema.validate(json.loads("".join(c["function"]["arguments"] for c in calls)),
                        NOTE["function"]["parameters"])

    after = asyncio.run(replica.generate({**body, "stream": False}))
    assert after["version"] == 2 and after["tool_plan"]["names"] == ["get_time"]
    (choice,) = openai_response(after, chat=True, model="m")["choices"]
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time" and choice["finish_reason"] == "tool_calls"
    jsonschema.validate(json.loads(call["function"]["arguments"]), TIME["function"]["parameters"])
