"""Function tools and the checks of the calls the service returns, shared by the tool-call tests (tests/serve on the
transformers engine, tests/vllm on vLLM): every call names one of the tools, and its arguments satisfy that tool's
``parameters`` (``jsonschema``)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

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


def check_call(name: str, arguments: str, tools: list[dict] = TOOLS) -> tuple[str, dict]:
    """``name`` is one of ``tools`` and ``arguments`` (a JSON string) satisfy that tool's parameters."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert name in schemas, name
    value = json.loads(arguments)
    jsonschema.validate(value, schemas[name])
    return name, value


def check_calls(calls: Any, tools: list[dict] = TOOLS) -> list[tuple[str, dict]]:
    """:func:`check_call` for each of an openai client's ``message.tool_calls`` (ids ``call_...``, type function)."""
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_"), call
        out.append(check_call(call.function.name, call.function.arguments, tools))
    return out


def openai_model(client: Any) -> str:
    """The one model the service lists (``GET /v1/models``)."""
    (card,) = client.models.list().data
    return card.id


def chat(client: Any, model: str, **kwargs: Any) -> Any:
    """A chat completion with the tools (defaults: :data:`ASK`, :data:`TOOLS`, 80 tokens, greedy)."""
    kwargs.setdefault("messages", ASK)
    kwargs.setdefault("tools", TOOLS)
    kwargs.setdefault("max_tokens", 80)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=model, **kwargs)
