"""The ``grammar`` kind's compile side: the whole output is a sentence of a context-free grammar written in Lark
(llguidance's dialect), built and checked in the grammar worker like the regex and JSON-schema kinds."""

from __future__ import annotations

from config import ScenarioError

from ...grammar import GrammarSpec, compile_grammar
from ...registry import register
from ..base import CompileResult
from ..llguidance_kind import GrammarKind
from .spec import GrammarScenario, strict_json_whitespace

__all__ = ["LarkGrammarKind", "compile_lark"]


def compile_lark(grammar: str, tokenizer, *, eos_token_id: int, worker=None) -> GrammarSpec:
    """A Lark grammar (its ``start`` rule is the whole output) as a :class:`GrammarSpec`; ``ValueError`` starting
    ``invalid Lark grammar:`` when llguidance refuses it."""
    return compile_grammar("lark", strict_json_whitespace(grammar), tokenizer, kind="grammar",
                           eos_token_id=eos_token_id, worker=worker)


class LarkGrammarKind(GrammarKind):
    """A Lark grammar; its ``start`` rule spans the whole output, which it guarantees (no check afterwards)."""

    config_model = GrammarScenario

    def compile(self, scenario, info, *, worker=None) -> CompileResult:
        try:
            spec = compile_lark(scenario.grammar, info, eos_token_id=info.eos_token_id, worker=worker)
        except ValueError as exc:
            if not str(exc).startswith("invalid Lark grammar: "):
                raise
            raise ScenarioError("compile", f"does not compile for the served tokenizer: grammar: {exc}",
                                field="grammar") from None
        return CompileResult(spec)


register(LarkGrammarKind())
