"""OpenAI's Responses API (``POST /v1/responses``) on top of the chat-completions layer.

:func:`responses_to_chat` turns a Responses body into the :class:`ChatCompletionRequest` the chat route would get
(``input`` and ``instructions`` -> ``messages``, ``text.format`` -> ``response_format``, ``max_output_tokens`` ->
``max_completion_tokens``, flat function ``tools`` -> chat tools), so the same mapping, limits, constraint and
replica calls serve both routes. :func:`chat_to_response` renders a chat completion as a Responses object, and
:func:`deployments.openai.responses_stream.responses_events` turns the chat stream chunks into the Responses event
stream (``response.created`` ... ``response.completed``).

Nothing is stored: ``store`` is accepted (true, false or absent) and has no effect, and what needs a stored
response (``previous_response_id``, ``conversation``, ``prompt``) is a 400 naming the field.

This module knows nothing of HTTP, handles or Serve.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from config import Limits
from deployments.openai.api import (
    PASSTHROUGH_FIELDS, ChatCompletionRequest, StructuredOutputs, refuse_unsupported_fields, validation_error,
)
from deployments.protocol import ServiceError
from deployments.openai.tool_calls import check_arguments

__all__ = [
    "ResponseObject",
    "ResponsesRequest",
    "chat_to_response",
    "renamed_error",
    "responses_to_chat",
]

# --------------------------------------------------------------------------------------------- request


class ResponseTextFormat(BaseModel):
    """``text.format``: ``text`` (no constraint), ``json_object`` (a JSON object) or ``json_schema``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = Field(description="Format kind.")
    name: str | None = Field(default=None, description="json_schema: a name for the schema (not used for decoding).")
    schema_: dict[str, Any] | None = Field(default=None, alias="schema", description="json_schema: the JSON Schema.")
    strict: bool | None = Field(default=None, description="json_schema: ignored, the constraint is always strict.")
    description: str | None = Field(default=None, description="json_schema: ignored.")


class ResponseTextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: ResponseTextFormat | None = Field(default=None, description="The output format (a one-off constraint).")
    verbosity: Literal["low", "medium", "high"] | None = Field(default=None, description="Accepted and ignored.")


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``: OpenAI's Responses API plus ``scenario``, ``structured_outputs``, ``top_k``.

    Fields outside the model: those in ``RESPONSES_IGNORED`` are ignored, those in ``RESPONSES_NEUTRAL`` accepted
    at their neutral value, the item controls go to the native request, and any other is a 400 naming it.
    """

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(
        default=None, description="The served model's name (GET /v1/models) or 'default'; another name is a 404."
    )
    input: str | list[dict[str, Any]] = Field(
        description="A user message, or a list of items: messages ({role, content}: a string or input_text / "
                    "output_text parts; also with type 'message'), and function_call / function_call_output items."
    )
    instructions: str | None = Field(default=None, description="A system message placed before the input.")
    text: ResponseTextConfig | None = Field(default=None, description="format: text, json_object or json_schema.")
    max_output_tokens: int | None = Field(default=None, ge=1, strict=True, description="Most tokens to generate.")
    temperature: float | None = Field(default=None, ge=0, le=100, strict=True, allow_inf_nan=False, description="0 = greedy.")
    top_p: float | None = Field(default=None, gt=0, le=1, strict=True, allow_inf_nan=False, description="Nucleus sampling mass.")
    stream: bool = Field(default=False, strict=True, description="Stream the Responses events as server-sent events.")
    store: bool | None = Field(default=None, description="Accepted; nothing is stored whatever its value.")
    previous_response_id: str | None = Field(
        default=None, description="Refused (400): this service stores no responses; send the whole conversation in input."
    )
    metadata: dict[str, str] | None = Field(default=None, description="Echoed in the answer.")
    user: str | None = Field(default=None, description="Accepted and ignored.")
    parallel_tool_calls: bool | None = Field(default=None, description="Echoed in the answer.")
    tools: list[dict[str, Any]] | None = Field(
        default=None, description="Function tools ({type: 'function', name, description, parameters, strict}); "
                                  "any other tool type is a 400."
    )
    tool_choice: str | dict[str, Any] | None = Field(
        default=None, description="'none', 'auto', 'required' or {type: 'function', name}."
    )
    scenario: str | None = Field(default=None, description="Extra field: name of a stored scenario.")
    structured_outputs: StructuredOutputs | None = Field(
        default=None, description="Extra field: a one-off constraint (exactly one of choice, json, regex, grammar)."
    )
    top_k: int | None = Field(default=None, ge=0, strict=True, description="Extra field: keep the k most likely tokens.")
    seed: int | None = Field(default=None, ge=0, strict=True, description="Extra field: random seed.")
    num_beams: int = Field(default=1, ge=1, strict=True, description="Extra field: beam search width (1 = sampling).")


#: Responses fields accepted and ignored
RESPONSES_IGNORED = frozenset({"service_tier", "prompt_cache_key", "prompt_cache_retention", "safety_identifier",
                               "stream_options"})
#: Responses fields accepted only at the value that means "off"
RESPONSES_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "truncation": ("disabled", None), "background": (False, None), "include": ([], None), "reasoning": (None, {}),
    "top_logprobs": (0, None), "max_tool_calls": (None,),
}
#: fields that need something stored on the server: a 400 naming them whatever their value (but null)
NEEDS_STORAGE = ("previous_response_id", "conversation", "prompt")
_TEXT_PARTS = ("input_text", "output_text", "text")


def _same(value: Any, neutral: Any) -> bool:
    """``value == neutral`` without booleans standing in for numbers (``false`` is not ``0``)."""
    return value is neutral or (isinstance(value, bool) == isinstance(neutral, bool) and value == neutral)


def _bad(message: str, param: str, status: int = 400) -> ServiceError:
    return ServiceError(status, message, {"type": "invalid_request_error", "param": param, "field": param})


def _check_fields(body: ResponsesRequest) -> dict[str, Any]:
    """The item controls to pass on; a 400 naming a field that needs storage, or every unknown / non-neutral one."""
    extra = body.model_extra or {}
    for name in NEEDS_STORAGE:
        value = body.previous_response_id if name == "previous_response_id" else extra.get(name)
        if value is not None:
            raise ServiceError(400, f"{name}: not supported: this service stores no responses, conversations or "
                                    f"prompts (store is ignored); send the whole conversation in input",
                               {"type": "invalid_request_error", "param": name, "fields": [name],
                                "code": "unsupported_field"})
    passed: dict[str, Any] = {}
    unknown: list[str] = []
    not_neutral: list[str] = []
    for name, value in extra.items():
        if name in RESPONSES_IGNORED:
            continue
        if name in RESPONSES_NEUTRAL:
            if not any(_same(value, neutral) for neutral in RESPONSES_NEUTRAL[name]):
                not_neutral.append(name)
        elif name in PASSTHROUGH_FIELDS:
            passed[name] = value
        else:
            unknown.append(name)
    refuse_unsupported_fields(unknown, not_neutral)
    return passed


def _text(content: Any, where: str) -> str:
    """A message's text: a string, or the text of its input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}: a string or a list of input_text parts", where, 422)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise _bad(f"{where}[{j}]: only text parts (input_text, output_text) are supported, got "
                       f"{kind or type(part).__name__!s}", f"{where}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _messages(body: ResponsesRequest, limits: Limits | None = None) -> list[dict[str, Any]]:
    """The chat messages for ``instructions`` and ``input``; with ``limits``, a ``function_call``'s ``arguments``
    nested deeper than ``max_json_depth`` is a 422 naming ``input[i].arguments``."""
    messages: list[dict[str, Any]] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role: one of user, system, developer, assistant (got {role!r})", f"{where}.role", 422)
            messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "reasoning":
            continue  # an earlier answer's thinking, sent back: not part of the prompt
        elif kind in ("function_call", "function_call_output"):
            if kind == "function_call":
                if limits is not None:
                    check_arguments(item.get("arguments"), f"{where}.arguments", limits)
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                    last["tool_calls"].append(call)  # parallel calls: one assistant message
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                output = item.get("output")
                messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                                 "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
        else:
            raise _bad(f"{where}.type: not supported here: {kind!r} (messages, function_call and function_call_output "
                       f"items are)", f"{where}.type")
    if not messages:
        raise _bad("input: give at least one message", "input", 422)
    return messages


def _chat_tools(body: ResponsesRequest) -> dict[str, Any]:
    """Chat ``tools`` / ``tool_choice`` for the Responses ones (nothing when there are none)."""
    tools, choice = body.tools or [], body.tool_choice
    if not tools and choice in (None, "none", "auto"):
        return {}
    chat_tools = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise _bad(f"tools[{i}].type: only function tools are supported here (got {tool.get('type')!r})",
                       f"tools[{i}].type")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        chat_tools.append({"type": "function", "function": function})
    out: dict[str, Any] = {"tools": chat_tools}
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise _bad(f"tool_choice.type: only 'function' is supported here (got {choice.get('type')!r})",
                       "tool_choice.type")
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        out["tool_choice"] = choice
    return out


def responses_to_chat(body: ResponsesRequest, limits: Limits | None = None) -> ChatCompletionRequest:
    """The chat-completions body that asks for what ``body`` asks (a 400/422 naming the Responses field); with
    ``limits``, the input's call arguments are held to them (:func:`deployments.openai.tool_calls.check_arguments`)."""
    passed = _check_fields(body)
    fmt = body.text.format if body.text is not None else None
    data: dict[str, Any] = {
        "model": body.model, "messages": _messages(body, limits), "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream, "scenario": body.scenario,
        "structured_outputs": body.structured_outputs, "top_k": body.top_k, "seed": body.seed,
        "num_beams": body.num_beams, **_chat_tools(body), **passed,
        **({"parallel_tool_calls": body.parallel_tool_calls} if body.parallel_tool_calls is not None else {}),
    }
    if body.stream:
        data["stream_options"] = {"include_usage": True}
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise _bad("text.format.schema: type 'json_schema' needs a 'schema'", "text.format.schema", 422)
        data["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name or "response",
                                                                          "schema": fmt.schema_, "strict": fmt.strict}}
    elif fmt is not None and fmt.type == "json_object":
        data["response_format"] = {"type": "json_object"}
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as error:
        raise renamed_error(validation_error(error.errors())) from None


_RENAMES = ((re.compile(r"\bresponse_format\.json_schema\.schema\b"), "text.format.schema"),
            (re.compile(r"\bresponse_format\b"), "text.format"),
            (re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"))


def _rename(value: Any) -> Any:
    if isinstance(value, str):
        for pattern, name in _RENAMES:
            value = pattern.sub(name, value)
        return value
    if isinstance(value, dict):
        return {key: _rename(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_rename(item) for item in value]
    return value


def renamed_error(error: ServiceError) -> ServiceError:
    """``error`` (from the chat mapping) with the chat fields named as the Responses body names them."""
    return ServiceError(error.status, _rename(error.message), _rename(error.detail))


# --------------------------------------------------------------------------------------------- answer


class ResponseObject(BaseModel):
    """A Responses API ``response`` object (the fields the openai client reads; output items as JSON objects)."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    incomplete_details: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    model: str
    output: list[dict[str, Any]] = Field(description="message, reasoning and function_call items.")
    usage: dict[str, Any] | None = None
    instructions: str | None = None
    text: dict[str, Any]
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    store: bool = False
    truncation: Literal["disabled"] = "disabled"
    scenario: str | None = Field(default=None, description="Extra field: the scenario used.")
    scenario_version: int | None = Field(default=None, description="Extra field: the scenario version pinned.")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_skeleton(body: ResponsesRequest, *, model: str, response_id: str | None = None,
                      created_at: int | None = None) -> dict[str, Any]:
    """The response object before any output (``status: in_progress``): the request's settings echoed."""
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    text_format: dict[str, Any] = {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)
    tools = [{"parameters": None, "strict": None, **tool} for tool in body.tools or []]
    return {
        "id": response_id or _new_id("resp"), "object": "response", "created_at": created_at or int(time.time()),
        "status": "in_progress", "incomplete_details": None, "error": None, "model": model, "output": [],
        "usage": None, "instructions": body.instructions, "text": {"format": text_format}, "tools": tools,
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
        "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
        "previous_response_id": None, "metadata": body.metadata or {}, "store": False, "truncation": "disabled",
    }


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or _new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def reasoning_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or _new_id("rs"), "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def function_call_item(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    return {"type": "function_call", "id": _new_id("fc"), "call_id": call.get("id") or _new_id("call"),
            "name": function.get("name"), "arguments": function.get("arguments") or "", "status": "completed"}


def finished(response: dict[str, Any], *, output: list[dict[str, Any]], finish_reason: str | None,
             usage: dict[str, Any] | None, error: str | None = None) -> dict[str, Any]:
    """``response`` (a skeleton) with its output, usage and final status."""
    done = {**response, "output": output, "usage": _usage(usage)}
    if error is not None or finish_reason == "error":
        done["status"] = "failed"
        done["error"] = {"code": "server_error", "message": error or "generation failed"}
    elif finish_reason == "length":
        done["status"] = "incomplete"
        done["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        done["status"] = "completed"
    return done


def chat_to_response(chat: dict[str, Any], body: ResponsesRequest, *, model: str) -> dict[str, Any]:
    """The Responses object for a chat completion (``openai_response(..., chat=True)``) of one choice."""
    choice = chat["choices"][0]
    message = choice.get("message") or {}
    status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
    output: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        output.append(reasoning_item(message["reasoning_content"], status))
    calls = message.get("tool_calls") or []
    if message.get("content") is not None or not calls:
        output.append(message_item(message.get("content") or "", status))
    output.extend(function_call_item(call) for call in calls)
    response = finished(response_skeleton(body, model=model), output=output, finish_reason=choice.get("finish_reason"),
                        usage=chat.get("usage"), error=choice.get("error"))
    response.update(scenario=chat.get("scenario"), scenario_version=chat.get("scenario_version"))
    return response
