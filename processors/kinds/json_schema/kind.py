"""The ``json_schema`` and ``json`` kinds: llguidance grammars (:class:`~processors.grammar.GrammarSpec`) for a
JSON Schema, or for any JSON value."""

from __future__ import annotations

from config import ScenarioError

from ...grammar import compile_json_schema
from ...registry import register
from ..base import CompileResult
from ..llguidance_kind import GrammarKind
from .spec import JsonSchemaScenario, JsonScenario


class JsonSchemaKind(GrammarKind):
    """JSON documents valid under a schema (no free whitespace; remote ``$ref``\\ s are never fetched).

    The grammar enforces the schema's closest enforceable relaxation; what it leaves out
    (:attr:`GrammarSpec.unenforced`) is checked on each finished output, which the replica regenerates when it
    fails. With ``strict: true`` such a schema is refused instead (``compile`` error, HTTP 400, naming each
    keyword and its place in ``unenforced``).
    """

    config_model = JsonSchemaScenario

    def compile(self, scenario, info, *, worker=None) -> CompileResult:
        spec = compile_json_schema(scenario.json_schema, info, eos_token_id=info.eos_token_id, worker=worker)
        if scenario.strict and spec.unenforced:
            raise ScenarioError(
                "compile", f"cannot be enforced as written (strict: true): the grammar library does not enforce "
                           f"{'; '.join(spec.unenforced)}",
                field="schema", detail={"unenforced": list(spec.unenforced)},
            )
        return CompileResult(spec)


class JsonKind(GrammarKind):
    """Any JSON value."""

    config_model = JsonScenario

    def compile(self, scenario, info, *, worker=None) -> CompileResult:
        return CompileResult(compile_json_schema(None, info, eos_token_id=info.eos_token_id, worker=worker))


register(JsonSchemaKind())
register(JsonKind())
