"""Tool calls at the HTTP edge (OpenAI ``tools``, ``tool_choice``, ``parallel_tool_calls``): the tools kind's plan
(``processors/kinds/tools/plan.py``, where the call schema is built and an output read as calls) answered as a
:class:`~deployments.protocol.ServiceError`, the bounds on the tool parts of a request that reach the prompt, and
calls as OpenAI stream deltas.

:func:`tool_setup` is :func:`processors.kinds.tools.plan.tool_plan` with its refusals answered with the same status,
message and detail; :func:`tool_call_deltas` turns a call list into OpenAI stream deltas. Both the chat route and
the Responses API use them.
"""

from __future__ import annotations

import json
from typing import Any

from config import ConstraintError, Limits
from config.settings import LimitExceeded, json_depth
from deployments.protocol import ServiceError
from deployments.scenario_errors import constraint_service_error
from processors.kinds.tools.plan import (
    FunctionDefinition, NamedToolChoice, Tool, ToolChoice, ToolPlan, limits_error, new_call_id, parse_tool_output,
    tool_plan,
)

__all__ = [
    "FunctionDefinition",
    "NamedToolChoice",
    "Tool",
    "ToolChoice",
    "ToolPlan",
    "check_arguments",
    "check_tool_fields",
    "new_call_id",
    "parse_tool_output",
    "stored_plan",
    "tool_call_deltas",
    "tool_setup",
]


def tool_setup(
    tools: list[Tool] | list[dict[str, Any]] | None, tool_choice: ToolChoice | str | dict[str, Any] | None,
    parallel_tool_calls: bool | None = None, limits: Limits | None = None, *, field: str = "tools",
    choice_field: str = "tool_choice",
) -> tuple[ToolPlan | None, list[dict[str, Any]] | None]:
    """``(plan, prompt_tools)`` of a request's tools (:func:`processors.kinds.tools.plan.tool_plan`, which says
    what each is and which checks apply).

    Raises:
        ServiceError: the plan's refusal (:class:`config.ConstraintError`) with its status, message and detail:
            400 for a ``tool_choice`` that names no tool or a function not in ``tools``; 422 past ``max_tools``
            (naming ``field``) and for a ``parameters`` schema refused, naming ``tools[i].function.parameters``.
    """
    try:
        return tool_plan(tools, tool_choice, parallel_tool_calls, limits, field=field, choice_field=choice_field)
    except ConstraintError as error:
        raise constraint_service_error(error) from None


def stored_plan(info: dict[str, Any] | None) -> ToolPlan | None:
    """The :class:`ToolPlan` a stored tool set's answer carries (``GenerateResponse.tool_plan``), for
    :func:`parse_tool_output`; ``None`` without one (:meth:`ToolPlan.from_info`)."""
    return ToolPlan.from_info(info)


def _limits_error(error: LimitExceeded) -> ServiceError:
    return constraint_service_error(limits_error(error))


def check_tool_fields(limits: Limits, tools: list[Any] | None, messages: list[Any] | None) -> None:
    """The bounds on the tool parts of a request that reach the prompt (every generating route; the model replica
    renders them, ``processors/tool_prompt.py``): ``tools`` within :meth:`config.Limits.check_tool_parameters`
    (``max_tools``, each ``parameters`` within the JSON-schema limits, all of them within ``max_schema_bytes``:
    ``/v1/generate`` takes tools for the prompt without :func:`tool_setup`), and each earlier call's
    ``arguments`` within ``max_json_depth`` (:func:`check_arguments`). ``messages``: :class:`ChatMessage` or dicts.

    Raises:
        ServiceError: 422 naming the field and the limit.
    """
    if tools:
        parameters = []
        for tool in tools:
            function = tool.get("function") if isinstance(tool, dict) else None
            parameters.append(function.get("parameters") if isinstance(function, dict) else None)
        try:
            limits.check_tool_parameters(parameters, "tools")
        except LimitExceeded as error:
            raise _limits_error(error) from None
    for i, message in enumerate(messages or ()):
        calls = message.get("tool_calls") if isinstance(message, dict) else getattr(message, "tool_calls", None)
        for j, call in enumerate(calls or ()):
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                check_arguments(function.get("arguments"), f"messages[{i}].tool_calls[{j}].function.arguments", limits)


def check_arguments(arguments: Any, field: str, limits: Limits) -> None:
    """A 422 naming ``field`` when a call's ``arguments`` (an object, or JSON text as OpenAI clients send them
    back) nest deeper than ``max_json_depth``, the bound of a JSON body: the prompt reads them as JSON
    (``processors/tool_prompt.py``). Text that is not JSON is left alone (the prompt shows it as text)."""
    limit = limits.max_json_depth
    error = ServiceError(422, f"{field}: nesting depth over {limit} exceeds the limit max_json_depth={limit}",
                         {"field": field, "limit_name": "max_json_depth", "limit": limit})
    if isinstance(arguments, str):
        if not arguments.lstrip().startswith(("{", "[")):
            return  # a scalar or not JSON: nothing nested
        try:
            arguments = json.loads(arguments)
        except RecursionError:  # deeper than the parser can go, so far deeper than the limit
            raise error from None
        except ValueError:
            return
    if isinstance(arguments, (dict, list)) and json_depth(arguments, stop_at=limit) > limit:
        raise error


def tool_call_deltas(calls: list[dict[str, Any]], piece: int = 32) -> list[dict[str, Any]]:
    """The stream deltas of ``calls`` as OpenAI sends them: per call a first delta with ``index``, ``id``, ``type``,
    ``function.name`` and ``arguments: ""``, then the arguments in fragments of ``piece`` characters."""
    deltas: list[dict[str, Any]] = []
    for index, call in enumerate(calls):
        function = call["function"]
        deltas.append({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                       "function": {"name": function["name"], "arguments": ""}}]})
        arguments = function["arguments"]
        for at in range(0, len(arguments), piece):
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": arguments[at:at + piece]}}]})
    return deltas
