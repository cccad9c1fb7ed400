"""The OpenAI-compatible layer: request and response bodies, and their mapping to and from the native API.

The ingress (``deployments/ingress/``) serves ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``
with the models of ``deployments/openai/models.py`` (re-exported here). :func:`openai_mapping` turns an OpenAI body
into a :class:`GenerateRequest` (a ``response_format`` or ``structured_outputs`` becomes a checked one-off scenario)
and the plan its outputs are read with as tool calls (:func:`openai_to_generate`: the request alone); :func:`openai_response` and
:func:`openai_stream_chunks` turn the replicas' answers back into OpenAI JSON bodies and stream chunks.

This module knows nothing of HTTP, handles or Serve, and does not import the ingress.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import ValidationError

from config import Limits
from config.echo import SHOWN_NAMES, shown_names, shown_path
from processors.scenarios import SCENARIO_TYPES, scenario_model
from deployments.json_body import BodyRejected, body_rejected, parse_json
from deployments.openai.models import (  # noqa: F401  (the models are this module's API too)
    DEFAULT_MODEL_NAME, IGNORED_FIELDS, NEUTRAL_FIELDS, PASSTHROUGH_FIELDS, AssistantMessage, ChatChoice,
    ChatCompletionRequest, ChatCompletionResponse, CompletionChoice, CompletionRequest, CompletionResponse,
    JsonSchemaFormat, ModelCard, ModelList, OpenAIChatMessage, ResponseFormat, StreamOptions, StructuredOutputs,
    TextPart, ToolCall, ToolCallFunction, structured_keys,
)
from deployments.openai.stream import openai_stream_chunks
from deployments.protocol import GenerateRequest, GenerateResponse, ServiceError
from deployments.scenario_errors import validated_one_off as _validated_inline
from deployments.openai.tool_calls import ToolPlan, parse_tool_output, tool_setup

__all__ = [
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "CompletionRequest",
    "CompletionResponse",
    "ModelList",
    "OpenAIMapping",
    "openai_mapping",
    "openai_response",
    "openai_stream_chunks",
    "openai_to_generate",
    "served_model_name",
    "validation_error",
]


# --------------------------------------------------------------------------------------------- mapping


def validation_error(errors: list[Any], rename: dict[str, str] | None = None) -> ServiceError:
    """A 422 whose message names each offending field (``messages.1.role: ...``).

    ``rename`` maps native field names to the ones the client sent (``max_new_tokens`` -> ``max_tokens``).
    The ingress answers every request validation error with it too. A key the client gave is shown bounded
    (:func:`config.echo.shown_path`), and the detail lists the first ``SHOWN_NAMES`` errors (the message counts
    them all).
    """
    rename = rename or {}
    parts: list[str] = []
    items: list[dict[str, Any]] = []
    for error in errors:
        loc = [str(p) for p in error.get("loc", ())]
        if loc and loc[0] in ("body", "query", "path", "header"):
            loc = loc[1:]
        if loc:
            loc[0] = rename.get(loc[0], loc[0])
        where = shown_path(loc) or "body"
        msg = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}")
        if len(items) < SHOWN_NAMES:
            items.append({"field": where, "message": msg, "type": error.get("type")})
    message = "; ".join(parts[:5]) + (f" (and {len(parts) - 5} more)" if len(parts) > 5 else "")
    return ServiceError(422, message or "invalid request", {"errors": items})


def served_model_name(model: str | None) -> str:
    """The name ``/v1/models`` reports: the default model's name, or the checkpoint's file/dir name."""
    if not model:
        return DEFAULT_MODEL_NAME
    path = Path(model)
    return path.stem if path.suffix.lower() == ".gguf" else (path.name or model)


def _inline_scenario(
    body: CompletionRequest | ChatCompletionRequest, limits: Limits | None = None
) -> tuple[dict[str, Any] | None, str | None]:
    """The one-off scenario asked for by ``response_format`` / ``structured_outputs`` and the field that asked."""
    fmt, so = body.response_format, body.structured_outputs
    if fmt is not None and fmt.type == "text":
        fmt = None
    keys = structured_keys()
    names = {key: f"structured_outputs.{key}" for key in keys}
    guided = {key: getattr(body, f"guided_{key}") for key in keys if getattr(body, f"guided_{key}") is not None}
    given = [name for name, value in (("scenario", body.scenario), ("response_format", fmt), ("structured_outputs", so),
                                      *((f"guided_{key}", True) for key in guided)) if value is not None]
    if len(given) > 1:
        fields = ", ".join(f"'guided_{key}'" for key in keys)
        raise ServiceError(422, f"give at most one of 'scenario', 'response_format', 'structured_outputs', "
                                f"{fields} (got {given})")
    if guided:  # vLLM's older extra fields: the same constraint as structured_outputs
        try:
            so = StructuredOutputs.model_validate(guided)
        except ValidationError as error:
            raise validation_error(error.errors(), {key: f"guided_{key}" for key in guided}) from None
        names = {key: f"guided_{key}" for key in names}
    if fmt is not None:
        if fmt.type == "json_object":  # OpenAI's JSON mode: a JSON object (the json kind allows any JSON value)
            return {"type": "json_schema", "schema": {"type": "object"}}, "response_format"
        if fmt.json_schema.schema_ is None:
            return {"type": "json"}, "response_format"
        return {"type": "json_schema", "schema": fmt.json_schema.schema_}, "response_format.json_schema.schema"
    if so is None:
        return None, None
    for type_name in SCENARIO_TYPES:  # the kinds vLLM's structured_outputs can name (their spec says which key)
        model = scenario_model(type_name)
        key = model.structured_output if model is not None else None
        if key is not None and model is not None and getattr(so, key, None) is not None:
            return {"type": type_name, str(model.constraint_field): getattr(so, key)}, names[key]
    schema = so.json_
    if isinstance(schema, str):
        try:
            schema = parse_json(schema, field=names["json"])  # the body's rules: finite, no dups, ...
        except BodyRejected as error:
            raise body_rejected(error) from None
        except json.JSONDecodeError as error:
            raise ServiceError(422, f"{names['json']}: not valid JSON: {error}") from None
        except RecursionError:  # deeper than the parser can go, so far deeper than any limit
            limit = (limits or Limits()).max_schema_depth
            raise ServiceError(422, f"{names['json']}: nesting depth over {limit} exceeds the limit "
                                    f"max_schema_depth={limit}", {"field": names["json"],
                                                                  "limit_name": "max_schema_depth", "limit": limit}) from None
        if not isinstance(schema, dict):
            raise ServiceError(422, f"{names['json']}: a JSON Schema must be an object")
    return {"type": "json_schema", "schema": schema}, names["json"]


def _same(value: Any, neutral: Any) -> bool:
    """``value == neutral`` without booleans standing in for numbers (``false`` is not ``0``)."""
    return value is neutral or (isinstance(value, bool) == isinstance(neutral, bool) and value == neutral)


def refuse_unsupported_fields(unknown: list[str], not_neutral: list[str]) -> None:
    """The 400 for fields this service does not take (``unknown``) or takes only at their neutral value
    (``not_neutral``), naming each (the first ``SHOWN_NAMES``, each bounded: :func:`config.echo.shown_names`);
    nothing when both lists are empty."""
    problems = []
    if unknown:
        shown, more = shown_names(sorted(unknown))
        problems.append(f"unknown field{'s' if len(unknown) > 1 else ''}: {', '.join(shown)}{more}")
    if not_neutral:
        shown, more = shown_names(sorted(not_neutral))
        problems.append(f"not supported here (only the neutral value is accepted): {', '.join(shown)}{more}")
    if problems:
        fields, _ = shown_names(sorted(unknown + not_neutral))
        raise ServiceError(400, "; ".join(problems), {"fields": fields, "type": "invalid_request_error",
                                                      "param": fields[0], "code": "unsupported_field"})


def _check_extra_fields(body: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """The item controls to pass on; a 400 naming every field that is neither known, ignored nor neutral."""
    passed: dict[str, Any] = {}
    unknown: list[str] = []
    not_neutral: list[str] = []
    for name, value in (body.model_extra or {}).items():
        if name in IGNORED_FIELDS:
            continue
        if name in NEUTRAL_FIELDS:
            if not any(_same(value, neutral) for neutral in NEUTRAL_FIELDS[name]):
                not_neutral.append(name)
        elif name in PASSTHROUGH_FIELDS and name in GenerateRequest.model_fields:
            passed[name] = value
        else:
            unknown.append(name)
    refuse_unsupported_fields(unknown, not_neutral)
    return passed


#: a model name every request may give for the served model, whatever its name
DEFAULT_ALIAS = "default"


def check_model(name: str | None, served: str) -> None:
    """A 404 like OpenAI's when ``name`` is given and is neither the served model nor ``default``."""
    if name and name not in (served, DEFAULT_ALIAS):
        raise ServiceError(404, f"The model `{name}` does not exist. This service serves `{served}` (GET /v1/models).",
                           {"type": "NotFoundError", "param": "model", "code": "model_not_found"})


class OpenAIMapping(NamedTuple):
    """An OpenAI body mapped onto the native API (:func:`openai_mapping`)."""

    #: the replica request
    request: GenerateRequest
    #: the OpenAI names of the mapped fields (for errors)
    rename: dict[str, str]
    #: how a chat body's outputs are read as tool calls (its own tools); None: as text, or with the plan a stored
    #: tool set's answer carries
    tool_plan: ToolPlan | None


def openai_to_generate(
    body: CompletionRequest | ChatCompletionRequest, limits: Limits | None = None, served: str | None = None
) -> tuple[GenerateRequest, dict[str, str]]:
    """The replica request for an OpenAI-style body, and the OpenAI names of the mapped fields (for errors):
    :func:`openai_mapping` without the tool plan."""
    mapped = openai_mapping(body, limits, served)
    return mapped.request, mapped.rename


def openai_mapping(
    body: CompletionRequest | ChatCompletionRequest, limits: Limits | None = None, served: str | None = None
) -> OpenAIMapping:
    """The replica request for an OpenAI-style body, the OpenAI names of the mapped fields (for errors) and the
    plan its outputs are read with as tool calls.

    With ``limits``, a one-off constraint is checked against them (a 422 naming the OpenAI field). With
    ``served`` (the served model's name), another ``model`` is a 404. Fields outside the body model are checked
    by :func:`_check_extra_fields` (a 400 naming them).
    """
    if served is not None:
        check_model(body.model, served)
    passed = _check_extra_fields(body)
    logprobs = _logprobs_asked(body)
    inline, field = _inline_scenario(body, limits)
    if inline is not None:
        inline = _validated_inline(inline, field, limits)
    prompt_tools = None
    plan = None
    if isinstance(body, ChatCompletionRequest):
        _check_stored_tool_choice(body)
        plan, prompt_tools = tool_setup(body.tools, body.tool_choice, body.parallel_tool_calls, limits)
        if plan is not None and (inline is not None or body.scenario is not None):
            raise ServiceError(400, f"tool_choice: {plan.mode!r} (with tools) cannot be combined with "
                                    f"{(field or 'scenario').split('.')[0]}: a call is decoded under its own "
                                    "constraint (give tool_choice 'none' to answer under that one; a stored tool "
                                    "set is named by its scenario alone, without tools)",
                               {"field": "tool_choice", "type": "invalid_request_error", "param": "tool_choice"})
        if plan is not None:
            inline = plan.scenario
    max_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    data: dict[str, Any] = {
        "scenario": body.scenario,
        "inline_scenario": inline,
        "max_new_tokens": body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "n": body.n,
        "num_beams": body.num_beams,
        "seed": body.seed,
        "stream": body.stream,
        "stop": [body.stop] if isinstance(body.stop, str) else body.stop,
        **passed,
    }
    if logprobs is not None:
        data["logprobs"] = logprobs
    if prompt_tools:
        data["tools"] = prompt_tools
    if isinstance(body, ChatCompletionRequest):
        data["messages"] = [m.to_chat_message().model_dump() for m in body.messages]
    else:
        data["prompt"] = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    rename = {"max_new_tokens": max_field}
    try:
        return OpenAIMapping(GenerateRequest.model_validate(data), rename, plan)
    except ValidationError as error:
        raise validation_error(error.errors(), rename) from None


def _check_stored_tool_choice(body: ChatCompletionRequest) -> None:
    """A stored ``scenario`` without the request's own ``tools``: how tools are called is the scenario's (a
    ``tools`` scenario's ``tool_choice`` and ``parallel_tool_calls``, one version at a time), so a request-level
    ``tool_choice`` or ``parallel_tool_calls`` is refused rather than ignored (400 naming it)."""
    if body.scenario is None or body.tools:
        return
    for name in ("tool_choice", "parallel_tool_calls"):
        if getattr(body, name) is not None:
            raise ServiceError(
                400, f"{name}: a stored scenario decides how its tools are called (a tools scenario's own "
                     f"tool_choice and parallel_tool_calls); leave {name} out, or store a version of scenario "
                     f"{body.scenario!r} with the {name} wanted", {"field": name, "type": "invalid_request_error",
                                                                 "param": name})


def _logprobs_asked(body: CompletionRequest | ChatCompletionRequest) -> int | None:
    """The native ``logprobs`` (alternatives per token; 0: the chosen token's only) or ``None`` when not asked."""
    chat = isinstance(body, ChatCompletionRequest)
    if chat:
        if body.logprobs is not None and not isinstance(body.logprobs, bool):
            raise ServiceError(422, "logprobs: a boolean on /v1/chat/completions (top_logprobs gives the count)",
                               {"field": "logprobs"})
        if body.top_logprobs and not body.logprobs:
            raise ServiceError(422, "top_logprobs: needs logprobs: true", {"field": "top_logprobs"})
        asked = (body.top_logprobs or 0) if body.logprobs else None
    else:
        if isinstance(body.logprobs, bool) or (body.logprobs is not None and not 0 <= body.logprobs <= 20):
            raise ServiceError(422, "logprobs: an integer from 0 to 20 on /v1/completions", {"field": "logprobs"})
        asked = body.logprobs
    if asked is not None and body.stream:
        raise ServiceError(400, "logprobs: not available with stream: true here (ask without streaming)",
                           {"field": "logprobs", "type": "invalid_request_error", "param": "logprobs"})
    return asked


def _chat_logprobs(items: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """OpenAI chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    if items is None:
        return None

    def entry(item: dict[str, Any]) -> dict[str, Any]:
        return {"token": item["token"], "logprob": item["logprob"], "bytes": list(item["token"].encode("utf-8"))}

    return {"content": [{**entry(item), "top_logprobs": [entry(top) for top in item.get("top", [])]} for item in items],
            "refusal": None}


def _completion_logprobs(items: list[dict[str, Any]] | None, text: str) -> dict[str, Any] | None:
    """OpenAI completions ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``."""
    if items is None:
        return None
    offsets, at = [], 0
    for item in items:
        offsets.append(at)
        at += len(item["token"])
    return {
        "tokens": [item["token"] for item in items],
        "token_logprobs": [item["logprob"] for item in items],
        "top_logprobs": [{top["token"]: top["logprob"] for top in item.get("top", [])} for item in items],
        "text_offset": offsets,
    }


def openai_response(result: GenerateResponse | dict[str, Any], *, chat: bool, model: str,
                    tools: ToolPlan | None = None) -> dict[str, Any]:
    """The OpenAI answer for a replica's :class:`GenerateResponse` (validated only when given as a dict); with
    ``tools`` (the request's own plan, :attr:`OpenAIMapping.tool_plan`) each output is read as tool calls."""
    response = result if isinstance(result, GenerateResponse) else GenerateResponse.model_validate(result)
    if tools is None:  # a stored tool set: read with the plan of the version that decoded it (from the replica)
        tools = ToolPlan.from_info(response.tool_plan)
    common = {
        "created": int(time.time()),
        "model": model,
        "usage": response.usage.model_dump(),
        "scenario": response.scenario,
        "scenario_version": response.version,
    }
    if chat:
        choices = [
            {"index": i, "message": _chat_message(o), "finish_reason": o.finish_reason,
             "logprobs": _chat_logprobs(o.logprobs)}
            for i, o in enumerate(response.outputs)
        ]
        for choice, output in zip(choices, response.outputs) if tools is not None else ():
            thought = output.reasoning_content is not None  # a think scenario: the calls follow the think block
            text = (output.answer or "") if thought else output.text
            content, calls, choice["finish_reason"] = parse_tool_output(text, output.finish_reason, tools)
            choice["message"] = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
            if thought:
                choice["message"]["reasoning_content"] = output.reasoning_content
        _add_output_fields(choices, response)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "choices": choices, **common}
    choices = [
        {"index": i, "text": o.text, "finish_reason": o.finish_reason, "logprobs": _completion_logprobs(o.logprobs, o.text)}
        for i, o in enumerate(response.outputs)
    ]
    _add_output_fields(choices, response)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "choices": choices, **common}


def _add_output_fields(choices: list[dict[str, Any]], response: GenerateResponse) -> None:
    """Extra fields on each choice: ``attempts`` (how many times the output was generated: a JSON output that
    failed validation against its schema is generated again), ``score`` (beam search: the score the output was
    ranked by; ``None`` when sampled) and, for an output that ended with ``finish_reason: "error"``, its ``error``."""
    for choice, output in zip(choices, response.outputs):
        choice["attempts"] = output.attempts
        choice["score"] = output.score
        if output.error is not None:
            choice["error"] = output.error


def _chat_message(output: Any) -> dict[str, Any]:
    """The assistant message: a think scenario's answer in ``content`` and its thinking in ``reasoning_content``."""
    if output.reasoning_content is None:
        return {"role": "assistant", "content": output.text}
    return {"role": "assistant", "content": output.answer or None, "reasoning_content": output.reasoning_content}
