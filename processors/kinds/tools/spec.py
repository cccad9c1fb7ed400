"""The ``tools`` kind's spec: a stored tool set (OpenAI function ``tools``, ``tool_choice``).

Torch-free (pydantic only): ``processors/scenarios.py`` finds it to build the ``Scenario`` union, and the ingress
validates bodies with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, ValidationError, ValidationInfo, field_validator, model_validator

from config.echo import shown_path
from config.scenario_base import ConstraintError, ScenarioBase

from .plan import NamedToolChoice, Tool, call_schema, tool_plan

if TYPE_CHECKING:
    from config.settings import Limits

__all__ = ['ToolsScenario']


class ToolsScenario(ScenarioBase):
    """A stored tool set: OpenAI function ``tools`` and how they are called (``tool_choice``,
    ``parallel_tool_calls``), served by name on the chat and Responses routes as tool calls.

    Validated like the request-level tools (:func:`~processors.kinds.tools.plan.tool_plan`: distinct names, a named
    ``tool_choice`` one of the tools, each ``parameters`` a valid JSON schema of an object within the JSON-schema
    limits) and compiled into the same constraint that function builds for a request. ``tool_choice`` is
    ``auto`` (the default: a call or a text answer), ``required`` or a named function; ``"none"`` is refused (a
    scenario that never calls is a plain one).
    """

    type: Literal["tools"] = Field(description="Scenario kind.")
    tools: list[dict[str, Any]] = Field(
        min_length=1, description="OpenAI function tools: {type: function, function: {name, description, parameters}}.")
    tool_choice: Literal["auto", "required"] | dict[str, Any] = Field(
        default="auto", description="auto, required, or {type: function, function: {name}} (exactly one call of it).")
    parallel_tool_calls: bool | None = Field(
        default=None, strict=True, description="false: at most one call per answer (default: several may come).")

    union_order: ClassVar[int] = 60
    constraint_field: ClassVar[str | None] = "tools"
    _plan: Any = PrivateAttr(default=None)  # plan(): (ToolPlan, prompt_tools), built at validation

    @classmethod
    def check_limits(cls, body: Mapping[str, Any], limits: Limits) -> Any:
        """The tools counted and their ``parameters`` measured, then the call schema they make together (several
        tools within the limits each may not be) held to the schema limits. Returns that call schema: the
        validation of this body takes it (:func:`~processors.kinds.tools.plan.tool_plan`'s ``built``), so the
        call schema of one body is built once."""
        tools = body.get("tools")
        if not isinstance(tools, list):
            return None
        limits.check_tool_count(len(tools), "tools")  # first: nothing below reads more tools than the limit
        parameters = []
        for tool in tools:
            function = tool.get("function") if isinstance(tool, Mapping) else None
            parameters.append(function.get("parameters") if isinstance(function, Mapping) else None)
        limits.check_tool_parameters(parameters, "tools")
        try:  # built only: the schema checks come with validation
            schema = call_schema(tools, body.get("tool_choice", "auto"), body.get("parallel_tool_calls"))
        except Exception:  # noqa: BLE001 - what is wrong with the body is named by validation
            return None
        if schema is not None:
            limits.check_schema(schema, "tools")
        return schema

    def plan(self, built: dict[str, Any] | None = None):
        """``(ToolPlan, prompt_tools)`` of this tool set (:func:`~processors.kinds.tools.plan.tool_plan`), built
        once (at validation, from the call schema of the limit check when given as ``built``) and kept: the
        compile takes the same plan."""
        if self._plan is None:
            self._plan = tool_plan(self.tools, self.tool_choice, self.parallel_tool_calls, built=built)
        return self._plan

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice(cls, choice: Any) -> Any:
        if choice == "none":
            raise ValueError("'none' is not a stored default (a scenario that never calls a tool is a plain "
                             "scenario); give auto, required or a named function")
        if isinstance(choice, str) and choice not in ("auto", "required"):
            raise ValueError(f"{choice!r} is not one of 'auto', 'required' or a named function "
                             "{type: function, function: {name}}")
        return choice

    @model_validator(mode="after")
    def _check_tools(self, info: ValidationInfo) -> ToolsScenario:
        def first(exc: ValidationError) -> str:
            err = exc.errors()[0]
            where = shown_path(err.get("loc", ()))
            return f"{where}: {err.get('msg')}" if where else str(err.get("msg"))

        for i, tool in enumerate(self.tools):
            try:
                Tool.model_validate(tool)
            except ValidationError as exc:
                raise ValueError(f"tools[{i}].{first(exc)}") from None
        if isinstance(self.tool_choice, dict):
            try:
                NamedToolChoice.model_validate(self.tool_choice)
            except ValidationError as exc:
                raise ValueError(f"tool_choice.{first(exc)}") from None
        try:
            self.plan((info.context or {}).get("prepared"))
        except ConstraintError as exc:
            raise ValueError(exc.message) from None
        return self
