"""The Responses API mapping without a service (``deployments/openai/responses.py``, ``deployments/openai/responses_stream.py``).

A Responses body -> the chat body; a chat answer -> a Responses object; chat stream chunks -> Responses events.
Every answer and event is validated with the installed `openai` client's own models (a strict pydantic check, not
the client's lenient construct). The HTTP route is tested in ``tests/serve/test_responses_api.py``.
"""

from __future__ import annotations

import asyncio

import pytest
from pydantic import TypeAdapter

from deployments.openai import responses as responses_api
from deployments.protocol import ServiceError
from deployments.openai.responses import ResponsesRequest, chat_to_response, renamed_error, responses_to_chat
from deployments.openai.responses_stream import responses_events

openai_types = pytest.importorskip("openai.types.responses")
EVENT = TypeAdapter(openai_types.ResponseStreamEvent)
MODEL = "SmolLM2-135M-Instruct"
USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather now.", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def _req(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": MODEL, "input": "Hi", **fields})


def _refused(status: int, **fields) -> ServiceError:
    with pytest.raises(ServiceError) as error:
        responses_to_chat(_req(**fields))
    assert error.value.status == status, error.value.message
    return error.value


def test_input_and_instructions_become_messages():
    chat = responses_to_chat(_req(input="Hello", instructions="Be brief.", max_output_tokens=9, temperature=0.5))
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."), ("user", "Hello")]
    assert (chat.max_completion_tokens, chat.temperature, chat.stream) == (9, 0.5, False)
    items = [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "c"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},  # sent back from an earlier answer: skipped
             {"role": "developer", "content": "d"}]
    chat = responses_to_chat(_req(input=items))
    assert [(m.role, m.content) for m in chat.messages] == [("user", "ab"), ("assistant", "c"), ("developer", "d")]


def test_text_format_becomes_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = responses_to_chat(_req(text={"format": {"type": "json_schema", "name": "A", "schema": schema, "strict": True}}))
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == schema
    assert responses_to_chat(_req(text={"format": {"type": "json_object"}})).response_format.type == "json_object"
    assert responses_to_chat(_req(text={"format": {"type": "text"}})).response_format is None
    assert responses_to_chat(_req(stream=True)).stream_options.include_usage
    assert "text.format.schema" in _refused(422, text={"format": {"type": "json_schema", "name": "A"}}).message


def test_refusals_name_the_field():
    for name in ("previous_response_id", "conversation", "prompt"):
        error = _refused(400, **{name: "x"})
        assert error.message.startswith(f"{name}:") and error.detail["param"] == name
    assert _refused(400, frob=1, n=2).detail["fields"] == ["frob", "n"]
    assert _refused(400, truncation="auto").detail["fields"] == ["truncation"]
    assert _refused(400, tools=[{"type": "web_search"}]).detail["param"] == "tools[0].type"
    assert _refused(400, input=[{"role": "user", "content": [{"type": "input_image"}]}]).detail["param"] == \
        "input[0].content[0]"
    assert _refused(400, input=[{"type": "item_reference", "id": "x"}]).detail["param"] == "input[0].type"
    assert "input[0].role" in _refused(422, input=[{"role": "tool", "content": "x"}]).message
    # accepted and ignored, or at the neutral value; item controls pass on
    chat = responses_to_chat(_req(store=True, user="u", metadata={"a": "b"}, truncation="disabled", include=[],
                                  service_tier="auto", exclude=[[1, 2]], tool_choice="auto"))
    assert chat.model_extra.get("exclude") == [[1, 2]] and "tools" not in (chat.model_extra or {})


def test_error_renames():
    error = renamed_error(ServiceError(422, "response_format.json_schema.schema.type: bad; max_completion_tokens: big",
                                       {"field": "response_format"}))
    assert error.message == "text.format.schema.type: bad; max_output_tokens: big" and error.detail == {"field": "text.format"}


def test_tools_map_to_the_chat_form():
    tools = responses_api._chat_tools(_req(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}))
    assert tools == {"tools": [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description",
                                                                                         "parameters", "strict")}}],
                     "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    assert responses_api._chat_tools(_req(tools=[WEATHER], tool_choice="required"))["tool_choice"] == "required"
    assert responses_api._chat_tools(_req(tool_choice="none")) == {}
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
             {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]}]
    messages = responses_api._messages(_req(input=items))
    assert messages[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]}
    assert messages[2:] == [{"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                            {"role": "tool", "tool_call_id": "call_2", "content": "rain"}]
    chat = responses_to_chat(_req(input=items, tools=[WEATHER]))  # the chat body takes them as they are
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool", "tool"]
    assert chat.messages[1].tool_calls[1].function.arguments == '{"city":"Oslo"}' and chat.messages[3].tool_call_id == "call_2"
    assert chat.tools[0].function.name == "get_weather" and chat.tool_choice is None


def _chat(message: dict, finish_reason: str = "stop", **choice) -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish_reason,
                         **choice}], "usage": USAGE, "scenario": None, "scenario_version": None}


def test_chat_answers_as_response_objects():
    body = _req(tools=[WEATHER], max_output_tokens=5, metadata={"k": "v"})
    r = openai_types.Response.model_validate(chat_to_response(_chat({"content": "hi"}), body, model=MODEL))
    assert (r.status, r.output_text, r.usage.total_tokens, r.metadata, r.tools[0].name) == ("completed", "hi", 10,
                                                                                           {"k": "v"}, "get_weather")
    r = openai_types.Response.model_validate(chat_to_response(_chat({"content": "h"}, "length"), body, model=MODEL))
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens" and r.output[0].status == "incomplete"
    r = openai_types.Response.model_validate(chat_to_response(_chat({"content": None, "tool_calls": [CALL]}, "tool_calls"),
                                                              body, model=MODEL))
    (call,) = r.output
    assert (r.status, call.type, call.call_id, call.name, call.arguments) == ("completed", "function_call", "call_1",
                                                                               "get_weather", '{"city":"Paris"}')
    assert call.id.startswith("fc_")
    r = openai_types.Response.model_validate(chat_to_response(
        _chat({"content": "yes", "reasoning_content": "hmm"}), body, model=MODEL))
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.output[0].content[0].text == "hmm"
    r = openai_types.Response.model_validate(chat_to_response(_chat({"content": "{"}, "error", error="bad JSON"), body,
                                                              model=MODEL))
    assert r.status == "failed" and r.error.message == "bad JSON"


async def _chunks(*deltas, finish="stop", error=None):
    for delta in deltas:
        yield {"choices": [{"index": 0, "delta": delta, "finish_reason": None}], "usage": None}
    if error:
        yield {"error": {"status": 500, "message": error}}
        return
    yield {"choices": [{"index": 0, "delta": {}, "finish_reason": finish}], "usage": None}
    yield {"choices": [], "usage": USAGE}


def _events(chunks, body=None) -> list:
    async def run():
        return [e async for e in responses_events(chunks, body or _req(stream=True), model=MODEL)]

    events = [EVENT.validate_python(e) for e in asyncio.run(run())]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_stream_events():
    events = _events(_chunks({"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"}))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    final = events[-1].response
    assert final.output_text == "Hello" == events[6].text and final.usage.output_tokens == 3
    assert final.id == events[0].response.id and final.output[0].id == events[2].item.id
    events = _events(_chunks({"content": "Hel"}, finish="length"))
    assert events[-1].type == "response.incomplete" and events[-1].response.incomplete_details.reason == "max_output_tokens"
    events = _events(_chunks({"content": "Hel"}, error="replica died"))
    kinds = [e.type for e in events]
    assert kinds[4:] == ["response.output_text.delta", "error", "response.output_text.done", "response.content_part.done",
                         "response.output_item.done", "response.failed"], kinds
    assert events[-1].response.error.message == "replica died" and events[-1].response.output[0].status == "incomplete"
    events = _events(_chunks(finish="stop"))  # an empty answer is still a message
    assert events[-1].response.output[0].type == "message" and events[-1].response.output_text == ""


def test_stream_reasoning_and_tool_calls():
    events = _events(_chunks({"reasoning_content": "hm"}, {"reasoning_content": "m"}, {"content": "yes"}))
    kinds = [e.type for e in events]
    assert kinds.count("response.reasoning_text.delta") == 2 and kinds.count("response.output_item.done") == 2
    assert [o.type for o in events[-1].response.output] == ["reasoning", "message"]
    assert events[-1].response.output[0].content[0].text == "hmm"
    pieces = [{"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}]
    events = _events(_chunks(*pieces, finish="tool_calls"))
    assert [e.type for e in events[2:]] == [
        "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    (call,) = events[-1].response.output
    assert (call.call_id, call.name, call.arguments) == ("call_1", "get_weather", '{"city":"Paris"}')
