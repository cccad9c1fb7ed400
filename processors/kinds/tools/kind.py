"""The ``tools`` kind: a stored tool set compiled into the JSON-schema grammar of its calls.

The call schema is the one :func:`~processors.kinds.tools.plan.tool_plan` builds for a request's own ``tools``
(the same function, not a copy): a call ``{"name": ..., "arguments": {...}}`` (or a list of them with parallel calls, or a
JSON string under ``auto``), compiled like a ``json_schema`` scenario (``strict: true`` refuses what the grammar
cannot enforce). The compiled scenario also carries how an output is read as calls and the tools for the prompt
(:attr:`~processors.compile.CompiledScenario.extras`, read by :meth:`ToolsKind.prompt_tools` and
:meth:`ToolsKind.output_plan`).
"""

from __future__ import annotations

from typing import Any


from ...registry import register
from ..base import CompileResult
from ..json_schema.kind import JsonSchemaKind
from ..json_schema.spec import JsonSchemaScenario
from .spec import ToolsScenario


def tools_setup(scenario: ToolsScenario) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(json_schema scenario body, tools)`` of a validated tool set: the checked one-off scenario of its plan
    (built at validation) and what :attr:`CompiledScenario.extras` holds (the plan's ``mode``, ``names``,
    ``parallel``, :meth:`~processors.kinds.tools.plan.ToolPlan.info`, and ``prompt_tools``)."""
    plan, prompt_tools = scenario.plan()
    return plan.scenario, {**plan.info(), "prompt_tools": prompt_tools}


class ToolsKind(JsonSchemaKind):
    """Function calls of a stored tool set (a JSON-schema grammar; each output checked against the schema)."""

    config_model = ToolsScenario  # type: ignore[assignment]  # its compile takes a ToolsScenario

    def compile(self, scenario, info, *, worker=None) -> CompileResult:
        body, tools = tools_setup(scenario)
        # built from parameters each checked as a JSON schema (tool_plan): not checked whole again (seconds for
        # a large tool set), as a request's own tools are not
        as_schema = JsonSchemaScenario.model_construct(type="json_schema", json_schema=body["schema"],
                                                       strict=scenario.strict)
        built = super().compile(as_schema, info, worker=worker)
        return CompileResult(built.constraint, extras=tools)

    def prompt_tools(self, extras):
        return extras["prompt_tools"] if extras is not None else None

    def output_plan(self, extras):
        return {k: extras[k] for k in ("mode", "names", "parallel")} if extras is not None else None


register(ToolsKind())
