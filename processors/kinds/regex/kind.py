"""The ``regex`` kind: the whole output matches a regular expression (an llguidance grammar)."""

from __future__ import annotations


from ...grammar import compile_regex
from ...registry import register
from ..base import CompileResult
from ..llguidance_kind import GrammarKind
from .spec import RegexScenario


class RegexKind(GrammarKind):
    """Rust ``regex`` syntax, matched against the whole output."""

    config_model = RegexScenario

    def compile(self, scenario, info, *, worker=None) -> CompileResult:
        return CompileResult(compile_regex(scenario.pattern, info, eos_token_id=info.eos_token_id, worker=worker))


register(RegexKind())
