"""``POST /v1/responses`` (OpenAI's Responses API) against the shared app, with the real `openai` client and raw HTTP.

Every answer of the tiny model is checked against its constraint (a pydantic model's schema, a JSON object); the
stream's events are checked by name and sequence number, and reassembled against the final response.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import requests
from pydantic import BaseModel

pytestmark = pytest.mark.serve


class Car(BaseModel):
    brand: str
    model: str


CAR_SCHEMA = Car.model_json_schema()
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
               "response.output_text.delta", "response.output_text.done", "response.content_part.done",
               "response.output_item.done", "response.completed"]


@pytest.fixture(scope="module")
def model(client):
    (card,) = client.models.list().data
    return card.id


def _sse(response: requests.Response) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event of a raw stream."""
    events = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((lines.get("event"), json.loads(lines["data"])))
    return events


def test_text_input(client, model):
    r = client.responses.create(model=model, input="Say hello.", max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete"), r
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and r.output_text == message.content[0].text != ""
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 8
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.max_output_tokens == 8 and r.temperature == 0 and r.error is None and r.text.format.type == "text"


def test_messages_and_instructions(client, model):
    ask = dict(model=model, max_output_tokens=6, temperature=0)
    plain = client.responses.create(input=[{"role": "user", "content": "Name a color."}], **ask)
    told = client.responses.create(
        instructions="You answer in French.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Rouge."}]},
               {"role": "developer", "content": "Be brief."},
               {"role": "user", "content": "Another one."}], **ask)
    assert told.instructions == "You answer in French." and told.output_text
    assert told.usage.input_tokens > plain.usage.input_tokens + 10  # instructions and the turns are in the prompt


def test_parse_with_a_pydantic_model(client, model):
    r = client.responses.parse(model=model, input="Describe a car as JSON.", text_format=Car, temperature=0,
                               max_output_tokens=60)
    assert r.status == "completed", r  # short enough to finish at temperature 0
    assert isinstance(r.output_parsed, Car), r
    jsonschema.validate(json.loads(r.output_text), CAR_SCHEMA)
    assert r.text.format.type == "json_schema" and r.text.format.name == "Car"


def test_json_object(client, model):
    r = client.responses.create(model=model, input="Give a JSON object with a name.", max_output_tokens=40,
                                temperature=1.0, text={"format": {"type": "json_object"}}, extra_body={"seed": 4})
    assert r.output_text.startswith("{"), r.output_text
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict), r.output_text
    else:
        assert r.incomplete_details.reason == "max_output_tokens"


def test_stream_reassembles_the_final_text(client, model):
    kinds, text = [], ""
    with client.responses.stream(model=model, input="Describe a car as JSON.", text_format=Car, temperature=0,
                                 max_output_tokens=60) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
        final = stream.get_final_response()
    assert kinds[:4] == TEXT_EVENTS[:4] and kinds[-5:] == TEXT_EVENTS[-5:], kinds
    assert kinds.count("response.output_text.delta") > 1
    assert final.status == "completed" and text == final.output_text
    assert isinstance(final.output_parsed, Car)
    jsonschema.validate(json.loads(text), CAR_SCHEMA)
    # the plain create(stream=True) too
    events = list(client.responses.create(model=model, input="Say hi.", max_output_tokens=4, temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    last = events[-1]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert last.type in ("response.completed", "response.incomplete") and last.response.output_text == deltas


def test_small_max_output_tokens_is_incomplete(client, model):
    r = client.responses.create(model=model, input="Write a long story about a dragon.", max_output_tokens=3,
                                temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens", r
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"


def test_refusals_name_the_field(client, model):
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=model, input="Hi", previous_response_id="resp_123")
    assert "previous_response_id" in error.value.message
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=model, input="Hi", extra_body={"frobnicate": True})
    assert "frobnicate" in error.value.message
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=model, input="Hi", tools=[{"type": "web_search"}])
    assert "tools[0].type" in error.value.message
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-4o", input="Hi")
    with pytest.raises(openai.UnprocessableEntityError) as error:
        client.responses.create(model=model, input="Hi", max_output_tokens=10**9)
    assert "max_output_tokens" in error.value.message


def test_raw_stream_events(serve_app, model):
    body = {"model": model, "input": "Say hi.", "max_output_tokens": 5, "temperature": 0, "stream": True,
            "store": False, "metadata": {"k": "v"}}
    r = requests.post(f"{serve_app.url}/v1/responses", json=body, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _sse(r)
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events), events
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert names[:4] == TEXT_EVENTS[:4] and names[-4:-1] == TEXT_EVENTS[-4:-1], names
    final = events[-1][1]["response"]
    assert names[-1] == ("response.completed" if final["status"] == "completed" else "response.incomplete")
    deltas = "".join(data["delta"] for name, data in events if name == "response.output_text.delta")
    assert deltas == final["output"][0]["content"][0]["text"] == events[-4][1]["text"]
    assert final["metadata"] == {"k": "v"} and final["usage"]["output_tokens"] <= 5
    created = events[0][1]["response"]
    assert created["status"] == "in_progress" and created["id"] == final["id"] and created["output"] == []


def test_raw_errors(serve_app, model):
    url = f"{serve_app.url}/v1/responses"
    r = requests.post(url, json={"model": model, "input": "Hi", "previous_response_id": "resp_1"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id", r.text
    r = requests.post(url, json={"model": model, "input": "Hi", "n": 2, "frob": 1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["fields"] == ["frob", "n"], r.text
    r = requests.post(url, json={"model": model, "input": "Hi", "tools": [{"type": "function", "name": "f",
                                                                          "parameters": {"type": "object"}}],
                                 "tool_choice": {"type": "function", "name": "g"}}, timeout=30)  # g: not a tool
    assert r.status_code == 400 and "tool_choice" in r.json()["error"]["message"], r.text
    r = requests.post(url, json={"model": model, "input": "Hi", "tools": [{"type": "file_search"}]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].type", r.text
    r = requests.post(url, json={"model": model, "input": "Hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                                                    "schema": {"type": "bogus"}}}},
                      timeout=30)
    assert r.status_code == 422 and r.json()["error"]["message"].startswith("text.format.schema"), r.text
    r = requests.post(url, json={"model": model, "input": [{"role": "user", "content": [{"type": "input_image",
                                                                                         "image_url": "x"}]}]}, timeout=30)
    assert r.status_code == 400 and "input[0].content[0]" in r.json()["error"]["message"], r.text
    schema = requests.get(f"{serve_app.url}/openapi.json", timeout=30).json()
    assert "/v1/responses" in schema["paths"]


def test_scenario_with_thinking(client, model, serve_app):
    labels = ["yes", "no", "maybe"]
    serve_app.put("t-think-resp", {"type": "labels", "labels": labels, "think": {"max_thinking_tokens": 8}})
    ask = dict(model=model, input="Is the sky blue?", temperature=0, extra_body={"scenario": "t-think-resp"})
    r = client.responses.create(**ask)
    assert [item.type for item in r.output] == ["reasoning", "message"] and r.output_text in labels, r
    assert r.scenario == "t-think-resp" and r.scenario_version == 1  # extra fields, as on chat completions
    reasoning, text = "", ""
    for event in client.responses.create(stream=True, **ask):
        if event.type == "response.reasoning_text.delta":
            reasoning += event.delta
        elif event.type == "response.output_text.delta":
            text += event.delta
    assert (reasoning, text) == (r.output[0].content[0].text, r.output_text)


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER,
          "strict": True}]


def test_function_tools(client, model):
    ask = dict(model=model, tools=TOOLS, temperature=0, max_output_tokens=60)
    # one call (with parallel calls the tiny model repeats the call until max_output_tokens)
    r = client.responses.create(input="What is the weather in Paris?", tool_choice="required",
                                parallel_tool_calls=False, **ask)
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and calls and r.tools[0].name == "get_weather", r.model_dump_json()
    for call in calls:
        assert call.name == "get_weather" and call.id.startswith("fc_") and call.call_id.startswith("call_"), call
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    # the next turn: the call and its result go back as items; tool_choice none answers in text
    call = calls[0]
    turn = [{"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    again = client.responses.create(input=turn, tool_choice="none", **{**ask, "max_output_tokens": 12})
    assert [item.type for item in again.output] == ["message"] and again.output_text
    assert again.usage.input_tokens > r.usage.input_tokens  # the call and its result are in the prompt
    # a named function, streamed
    kinds = []
    with client.responses.stream(input="Weather in Oslo?", tool_choice={"type": "function", "name": "get_weather"},
                                 **ask) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_response()
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_weather", final
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
