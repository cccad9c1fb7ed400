"""The ``grammar`` kind: the whole output is a sentence of a context-free grammar written in Lark (llguidance's
dialect), built and checked in the grammar worker like the regex and JSON-schema kinds."""

from __future__ import annotations

from config import GrammarScenario, ScenarioError

from ..grammar import compile_lark
from ..registry import register
from .base import CompileResult
from .json_schema import GrammarKind


class LarkGrammarKind(GrammarKind):
    """A Lark grammar; its ``start`` rule spans the whole output, which it guarantees (no check afterwards)."""

    config_model = GrammarScenario

    def compile(self, scenario, info, *, worker=None) -> CompileResult:
        try:
            spec = compile_lark(scenario.grammar, info, eos_token_id=info.eos_token_id, worker=worker)
        except ValueError as exc:
            if not str(exc).startswith("grammar: "):
                raise
            raise ScenarioError("compile", f"does not compile for the served tokenizer: {exc}", field="grammar") from None
        return CompileResult(spec)


register(LarkGrammarKind())
