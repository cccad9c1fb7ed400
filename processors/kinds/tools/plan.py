"""The tools kind's plan: OpenAI function ``tools`` + ``tool_choice`` + ``parallel_tool_calls`` read into the
schema of the calls the model may write, and a finished output read back as calls.

A request's own tools (the chat and Responses routes) and a stored tool set (a ``tools`` scenario) go through the
same :func:`tool_plan`. An output is decoded under the one-off ``json_schema`` scenario of the call schema, so a
call gets the same whole-schema guarantee as a ``response_format`` json_schema: the function name is one of the
tools, the arguments satisfy that function's ``parameters``. The model writes (and the prompt asks for,
``processors/tool_prompt.py``):

* a call: ``{"name": "<function>", "arguments": {...}}``;
* several calls (``parallel_tool_calls`` true, the default, with ``"required"`` or ``"auto"``): a JSON list of them,
  at least one;
* under ``"auto"``, instead of a call, a text answer as a JSON string (``"Hello!"``), returned as ``content``.

``"required"``: at least one call of any tool; a named function ``{"type": "function", "function": {"name": f}}``:
exactly one call of ``f``; ``"none"``: no constraint from the tools (they are still shown in the prompt).
:func:`parse_tool_output` turns a finished output into ``(content, tool_calls, finish_reason)``.

Torch-free (pydantic, jsonschema). A refusal is a :class:`config.ConstraintError` naming the field as the client
sent it, with its status; the HTTP edge (``deployments/openai/tool_calls.py``) answers it.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections import Counter
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from config.echo import shown_message, shown_path
from config.limit_checks import LimitExceeded
from config.scenario_base import ConstraintError, ScenarioError, scenario_to_dict
from processors.kinds.json_schema.spec import JsonSchemaScenario

if TYPE_CHECKING:
    from config.settings import Limits

__all__ = [
    "FunctionDefinition",
    "NamedToolChoice",
    "Tool",
    "ToolChoice",
    "ToolPlan",
    "call_schema",
    "limits_error",
    "new_call_id",
    "parse_tool_output",
    "tool_plan",
]


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:\-]+$", description="The function name.")
    description: str | None = Field(default=None, description="What the function does (shown to the model).")
    parameters: dict[str, Any] | None = Field(
        default=None, description="JSON Schema of the arguments (an object); absent: no arguments.")
    strict: bool | None = Field(default=None, description="Ignored: the arguments always satisfy the schema.")


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = Field(description="Only function tools are supported.")
    function: FunctionDefinition


class _FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = Field(description="Only function tools are supported.")
    function: _FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """How an output is read: ``mode`` (``auto``, ``required``, ``named``), the allowed function ``names``,
    whether several calls may come (``parallel``), and the checked one-off ``scenario`` decoded under (empty for
    a plan read back from an answer: the constraint was the stored one).

    A stored tool set's answer carries the plan of the version that decoded it as :meth:`info`
    (``GenerateResponse.tool_plan``), read back with :meth:`from_info`."""

    mode: str
    names: tuple[str, ...]
    parallel: bool
    scenario: dict[str, Any]

    def info(self) -> dict[str, Any]:
        """``{mode, names, parallel}``: the plan as an answer carries it (JSON)."""
        return {"mode": self.mode, "names": list(self.names), "parallel": self.parallel}

    @classmethod
    def from_info(cls, info: dict[str, Any] | None) -> ToolPlan | None:
        """The plan of :meth:`info` (``None`` without one), for :func:`parse_tool_output`."""
        if not info:
            return None
        return cls(mode=info["mode"], names=tuple(info["names"]), parallel=bool(info["parallel"]), scenario={})


def _bad(field: str, message: str, status: int = 400) -> ConstraintError:
    return ConstraintError(status, f"{field}: {message}",
                           {"field": field, "type": "invalid_request_error", "param": field})


def limits_error(error: LimitExceeded) -> ConstraintError:
    """A limit of the tools, answered with the limit's own status and detail."""
    return ConstraintError(error.status, str(error), error.detail())


#: keywords whose values are data, not schemas (a "$ref" string inside them is not a reference)
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _new_ref(ref: str, prefix: str) -> str:
    pointer = ref[1:]
    for section, tag in (("/$defs/", "_"), ("/definitions/", "_d_")):
        if pointer.startswith(section):
            return f"#/$defs/{prefix}{tag}{pointer[len(section):]}"
    return f"#/$defs/{prefix}{pointer}"  # "#" (the parameters themselves), "#/properties/x", ...


def _rewrite_refs(node: Any, prefix: str) -> Any:
    if isinstance(node, dict):
        return {key: (_new_ref(value, prefix) if key == "$ref" and isinstance(value, str) and value.startswith("#")
                      else value if key in _DATA_KEYWORDS else _rewrite_refs(value, prefix))
                for key, value in node.items()}
    if isinstance(node, list):
        return [_rewrite_refs(item, prefix) for item in node]
    return node


def _has_local_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return any((key == "$ref" and isinstance(value, str) and value.startswith("#"))
                   or (key not in _DATA_KEYWORDS and _has_local_ref(value)) for key, value in node.items())
    return isinstance(node, list) and any(_has_local_ref(item) for item in node)


def _arguments_schema(params: dict[str, Any], prefix: str, defs: dict[str, Any]) -> dict[str, Any]:
    """The arguments' schema inside the call schema; a schema with local references (``#/$defs/X``, pydantic's
    nested models) moves to the root's ``$defs`` under ``prefix`` with its references rewritten."""
    if not _has_local_ref(params):
        return params
    root = {key: value for key, value in params.items() if key not in ("$defs", "definitions")}
    defs[prefix] = _rewrite_refs(root, prefix)
    for section, tag in (("$defs", "_"), ("definitions", "_d_")):
        for name, schema in (params.get(section) or {}).items():
            defs[f"{prefix}{tag}{name}"] = _rewrite_refs(schema, prefix)
    return {"$ref": f"#/$defs/{prefix}"}


def _parameters(tool: Tool, i: int, field: str, limits: Limits | None, check: bool = True) -> dict[str, Any]:
    from processors.scenarios import checked_one_off  # the union of every kind: above this module

    params = tool.function.parameters
    if params is None:  # OpenAI: a function without parameters takes none
        return {"type": "object", "properties": {}, "additionalProperties": False}
    where = f"{field}[{i}].function.parameters"
    if params.get("type", "object") != "object":
        raise _bad(where, "the arguments' schema must describe an object (type: object)", 422)
    if not check:
        return params
    checked = checked_one_off({"type": "json_schema", "schema": params}, where, limits)["schema"]
    if params.get("$schema") not in (None, *_CALL_DIALECTS):
        # checked as its own dialect above; inside the call schema it is read as the call schema's dialect
        # (2020-12), so it is checked as that too (the whole call schema is not checked again: tool_plan)
        _check_in_call_dialect(params, where)
    return checked


#: the JSON-schema dialect of the call schema (it has no $schema: jsonschema reads it as the latest, 2020-12)
_CALL_DIALECTS = ("https://json-schema.org/draft/2020-12/schema", "https://json-schema.org/draft/2020-12/schema#")


def _check_in_call_dialect(params: dict[str, Any], where: str) -> None:
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import Draft202012Validator

    try:
        Draft202012Validator.check_schema(params)
    except SchemaError as error:
        path = shown_path(error.absolute_path, "/") or "<root>"
        raise _bad(where, f"schema: invalid JSON Schema at {path}: {shown_message(error.message)}", 422) from None


def _call_scenario(schema: dict[str, Any], field: str, limits: Limits | None) -> dict[str, Any]:
    """The one-off ``json_schema`` scenario of a call schema built from checked parameters: the limits of a
    one-off constraint (the call schema's depth and size: several tools within the limits each may not be), then
    the scenario as ``processors.scenarios.checked_one_off`` gives it, without checking the schema against the
    JSON-schema meta-schema again (each ``parameters`` was, and the rest is built here; that check is seconds for
    a large schema, and the model replica makes it once more where it compiles the constraint, off its event
    loop)."""
    from processors.scenarios import check_scenario_body, field_error

    body = {"type": "json_schema", "schema": schema}
    try:
        check_scenario_body(body, limits, one_off=True, field=field)
    except ScenarioError as error:
        raise field_error(error, field, JsonSchemaScenario.constraint_field) from None
    return scenario_to_dict(JsonSchemaScenario.model_construct(type="json_schema", json_schema=schema))


def _assemble(names: list[str], chosen: range | list[int], params: list[dict[str, Any]], mode: str,
              parallel: bool) -> dict[str, Any]:
    """The call schema: a call of one of the ``chosen`` functions (or a list of them, ``parallel``; or a text
    answer as a JSON string, ``auto``)."""
    defs: dict[str, Any] = {}
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": names[i]}, "arguments": _arguments_schema(params[i], f"tool{i}", defs)}}
             for i in chosen]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    answer = {"type": "array", "items": one, "minItems": 1} if parallel else one
    schema = {"anyOf": [{"type": "string"}, answer]} if mode == "auto" else answer
    return {**schema, "$defs": defs} if defs else schema


def _read(tools: list[Tool] | list[dict[str, Any]] | None, tool_choice: ToolChoice | str | dict[str, Any] | None,
          parallel_tool_calls: bool | None, limits: Limits | None, field: str, choice_field: str, check: bool,
          built: dict[str, Any] | None = None):
    """:func:`tool_plan`'s reading: ``(mode, names, parallel, schema, prompt_tools)``; ``mode`` is ``None`` when
    the output is not a call (``schema`` then ``None``), the whole is ``None`` without tools. ``check``: the
    ``parameters`` checked as JSON schemas; ``built``: the call schema already assembled from these very tools
    (:func:`call_schema`), taken as it is."""
    tools = tools or []
    if limits is not None:
        try:
            limits.check_tool_count(len(tools), field)
        except LimitExceeded as error:
            raise limits_error(error) from None
    parsed = [t if isinstance(t, Tool) else Tool.model_validate(t) for t in tools]
    if isinstance(tool_choice, dict):
        tool_choice = NamedToolChoice.model_validate(tool_choice)
    if tool_choice is not None and not isinstance(tool_choice, NamedToolChoice) and \
            tool_choice not in ("none", "auto", "required"):
        raise _bad(choice_field, f"{tool_choice!r} is not one of 'none', 'auto', 'required' or a named function")
    names = [t.function.name for t in parsed]
    duplicates = sorted(name for name, count in Counter(names).items() if count > 1)
    if duplicates:
        raise _bad(field, f"function names must be distinct (given more than once: {', '.join(duplicates)})")
    if not parsed:
        if tool_choice is not None and tool_choice != "none":
            raise _bad(choice_field, "needs 'tools' (no function to call was given)")
        return None
    if limits is not None:
        try:
            limits.check_tool_parameters([t.function.parameters for t in parsed], field)
        except LimitExceeded as error:
            raise limits_error(error) from None
    params = [_parameters(tool, i, field, limits, check)  # every tool's, chosen or not
              for i, tool in enumerate(parsed)]
    prompt_tools = [{"type": "function", "function": t.function.model_dump(exclude_none=True, exclude={"strict"})}
                    for t in parsed]
    mode = "auto" if tool_choice is None else "named" if isinstance(tool_choice, NamedToolChoice) else tool_choice
    if mode == "none":
        return None, names, False, None, prompt_tools
    chosen: range | list[int] = range(len(parsed))
    if isinstance(tool_choice, NamedToolChoice):
        chosen = [i for i, name in enumerate(names) if name == tool_choice.function.name]
        if not chosen:
            raise _bad(f"{choice_field}.function.name", f"{tool_choice.function.name!r} is not one of the tools "
                                                         f"({', '.join(names)})")
    parallel = parallel_tool_calls is not False and mode != "named"
    schema = built if built is not None else _assemble(names, chosen, params, mode, parallel)
    return mode, tuple(names[i] for i in chosen), parallel, schema, prompt_tools


def tool_plan(
    tools: list[Tool] | list[dict[str, Any]] | None, tool_choice: ToolChoice | str | dict[str, Any] | None,
    parallel_tool_calls: bool | None = None, limits: Limits | None = None, *, field: str = "tools",
    choice_field: str = "tool_choice", built: dict[str, Any] | None = None,
) -> tuple[ToolPlan | None, list[dict[str, Any]] | None]:
    """The constraint and the prompt tools for ``tools`` + ``tool_choice`` + ``parallel_tool_calls``.

    Returns ``(plan, prompt_tools)``: ``plan`` is ``None`` when the output is not a call (no tools, or
    ``tool_choice: "none"``); ``plan.scenario`` is the checked one-off ``json_schema`` scenario to decode under.
    ``prompt_tools`` are the tools in OpenAI's chat shape for the prompt (``GenerateRequest.tools``), ``None``
    without tools. ``field`` / ``choice_field`` name the fields in errors (the Responses API names them its way).
    ``built``: the call schema :func:`call_schema` assembled from these very tools (a tools scenario's limit
    check), taken as it is: the call schema of one body is built once.

    With ``limits``, the tools are counted first (``max_tools``), then the size and depth of their ``parameters``
    measured (:meth:`config.Limits.check_tool_parameters`), before any tool is read; every check applies
    whatever ``tool_choice`` is (``"none"`` too: the tools still reach the prompt). The work after is linear in
    the tools: each ``parameters`` is checked once (as a JSON schema, within the limits), the call schema is
    built from them and held to the limits of a one-off constraint.

    Raises:
        ConstraintError: 400 for a ``tool_choice`` that names no tool or a function not in ``tools``; 422 past
            ``max_tools`` (naming ``field``) and (from the JSON-schema limits and checks) for a ``parameters``
            schema refused, naming ``tools[i].function.parameters``.
        pydantic.ValidationError: a tool or a named ``tool_choice`` not of OpenAI's shape.
    """
    read = _read(tools, tool_choice, parallel_tool_calls, limits, field, choice_field, True, built)
    if read is None:
        return None, None
    mode, names, parallel, schema, prompt_tools = read
    if mode is None:
        return None, prompt_tools
    return ToolPlan(mode=mode, names=names, parallel=parallel,
                    scenario=_call_scenario(schema, field, limits)), prompt_tools


def call_schema(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> dict[str, Any] | None:
    """The call schema of a tool set as given (its ``parameters`` not yet checked as JSON schemas): what a tools
    scenario's limit check measures, then hands to :func:`tool_plan` (``built``). ``None`` when the output is not
    a call. Raises what :func:`tool_plan` raises for what it reads."""
    read = _read(tools, tool_choice, parallel_tool_calls, None, "tools", "tool_choice", False)
    return None if read is None else read[3]


def new_call_id() -> str:
    """A call id as OpenAI writes them: ``call_`` and 24 random characters."""
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_output(text: str, finish_reason: str, plan: ToolPlan | None
                      ) -> tuple[str | None, list[dict[str, Any]] | None, str]:
    """``(content, tool_calls, finish_reason)`` of one finished output of a request decoded under ``plan``.

    A call (or a list of calls) becomes OpenAI ``tool_calls`` (``arguments`` as JSON text), ``content`` ``None``
    and ``finish_reason: "tool_calls"``; a text answer (``"auto"``: a JSON string) becomes ``content``. An output
    that did not finish (``length``, ``error``: never a valid call) comes back as text with its finish reason.
    """
    if plan is None or finish_reason != "stop":
        return text, None, finish_reason
    try:
        value = json.loads(text)
    except ValueError:
        return text, None, finish_reason
    if isinstance(value, str):
        return value, None, "stop"
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(c, dict) and c.get("name") in plan.names and "arguments" in c for c in items):
        return text, None, finish_reason  # not a call (cannot happen under the plan's schema)
    calls = [{"id": new_call_id(), "type": "function",
              "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
             for c in items]
    return None, calls, "tool_calls"
