"""The compile side shared by the kinds built on an llguidance grammar (``json_schema``, ``json``, ``regex``,
``grammar``, ``tools``): a checked :class:`~processors.grammar.GrammarSpec` and a per-row matcher. A module, not a
kind package: the registry loads the packages of ``processors/kinds/`` only."""

from __future__ import annotations

from ..grammar import GrammarCursor, GrammarSpec
from .base import Capabilities, ConstraintKind

__all__ = ["GrammarKind"]


class GrammarKind(ConstraintKind):
    """A kind compiled into a checked llguidance grammar; the cursor is a per-row matcher (bitmask steps)."""

    compiled_type = GrammarSpec
    needs_tokenizer = True
    capabilities = Capabilities(grammar=True)

    def cursor(self, constraint, info) -> GrammarCursor:
        if info is None:
            raise ValueError(f"a {constraint.kind} scenario needs tokenizer= (a tokenizer or a TokenizerInfo) "
                             "to build its matcher")
        return GrammarCursor(constraint, info)

    def output_check(self, constraint) -> GrammarSpec | None:
        """The spec itself when it validates finished outputs (the JSON kinds: :attr:`GrammarSpec.validates`)."""
        return constraint if constraint.validates else None

    def llguidance_grammar(self, constraint) -> str:
        return constraint.grammar
