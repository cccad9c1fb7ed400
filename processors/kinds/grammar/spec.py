"""The ``grammar`` kind's spec: the whole output is a sentence of a Lark grammar (field ``grammar``).

Torch-free (pydantic only): ``config/scenarios.py`` imports it to build the ``Scenario`` union, and the ingress
validates bodies with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, field_validator

from config.limit_checks import LimitExceeded
from config.scenario_base import ScenarioBase

if TYPE_CHECKING:
    from config.settings import Limits

__all__ = ["GrammarScenario", "check_grammar", "grammar_regexes"]


def check_grammar(grammar: str, limits: Limits, field: str = "grammar") -> None:
    """Raise ``LimitExceeded`` for a Lark grammar larger than ``max_grammar_bytes`` (UTF-8) or with a ``/regex/``
    terminal over the regex limits (``Limits.check_regex``), named by its line."""
    size = len(grammar.encode("utf-8", "surrogatepass"))
    if size > limits.max_grammar_bytes:
        raise LimitExceeded(field, f"{size} bytes", "max_grammar_bytes", limits.max_grammar_bytes)
    for line, pattern in grammar_regexes(grammar):
        try:
            limits.check_regex(pattern, field)
        except LimitExceeded as exc:
            raise LimitExceeded(field, f"the regex on line {line}: {exc.what}", exc.limit_name, exc.limit) from None


def grammar_regexes(grammar: str) -> list[tuple[int, str]]:
    """The ``/regex/`` literals of a Lark grammar with the line of each, as Lark reads them: outside ``"..."``
    strings and ``//`` comments, from a ``/`` to the next one not escaped by a backslash (flags after it)."""
    found: list[tuple[int, str]] = []
    i, n, line = 0, len(grammar), 1
    while i < n:
        c = grammar[i]
        if c == "\n":
            line += 1
        elif c == '"':  # a string literal: skip it, escapes included
            i += 1
            while i < n and grammar[i] != '"':
                if grammar[i] == "\\":
                    i += 1
                elif grammar[i] == "\n":
                    line += 1
                i += 1
        elif c == "/" and grammar.startswith("//", i):  # a comment, to the end of the line
            end = grammar.find("\n", i)
            i = n if end < 0 else end
            continue
        elif c == "/":
            start = i + 1
            i = start
            while i < n and grammar[i] != "/" and grammar[i] != "\n":
                i += 2 if grammar[i] == "\\" else 1
            found.append((line, grammar[start:min(i, n)]))
            if i < n and grammar[i] == "\n":
                continue  # an unclosed regex: the grammar library reports it
        i += 1
    return found


class GrammarScenario(ScenarioBase):
    """Constrain output to the sentences of a context-free grammar (field ``grammar``).

    The grammar is Lark text as llguidance reads it (``start: "yes" | "no" | NUMBER`` with ``NUMBER: /[0-9]+/``;
    its ``start`` rule is the whole output; ``/regex/`` terminals in Rust syntax; ``%ignore``, ``%import common``
    and llguidance's extensions as documented there). It is checked and built by the grammar library when the
    scenario compiles (a syntax error is a ``compile`` error naming ``grammar``); here only its size and its
    regexes are bounded (``limits.max_grammar_bytes``, ``max_regex_length``, ``max_regex_repeat``).
    """

    type: Literal["grammar"] = Field(description="Scenario kind.")
    grammar: str = Field(min_length=1, description="The Lark grammar the whole output must be a sentence of.")

    constraint_field: ClassVar[str | None] = "grammar"
    structured_output: ClassVar[str | None] = "grammar"

    @classmethod
    def check_limits(cls, body: Mapping[str, Any], limits: Limits) -> None:
        grammar = body.get("grammar")
        if isinstance(grammar, str):
            check_grammar(grammar, limits, "grammar")

    @field_validator("grammar")
    @classmethod
    def _not_blank(cls, grammar: str) -> str:
        if not grammar.strip():
            raise ValueError("must not be blank (a Lark grammar with a start rule)")
        if "\x00" in grammar:
            raise ValueError("must not contain NUL characters")
        return grammar
