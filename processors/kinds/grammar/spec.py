"""The ``grammar`` kind's spec: the whole output is a sentence of a Lark grammar (field ``grammar``).

Torch-free (pydantic only): ``processors/scenarios.py`` finds it to build the ``Scenario`` union, and the ingress
validates bodies with it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, field_validator

from config.limit_checks import LimitExceeded
from config.scenario_base import ScenarioBase

if TYPE_CHECKING:
    from config.settings import Limits

__all__ = ["GrammarScenario", "check_grammar", "grammar_json_schemas", "grammar_regexes", "strict_json_whitespace"]


def check_grammar(grammar: str, limits: Limits, field: str = "grammar") -> None:
    """Raise ``LimitExceeded`` for a Lark grammar larger than ``max_grammar_bytes`` (UTF-8), with a ``/regex/``
    terminal over the regex limits (``Limits.check_regex``), or with a ``%json {...}`` schema over the JSON-schema
    limits (``Limits.check_schema``: depth, size, its patterns), each named by its line."""
    size = len(grammar.encode("utf-8", "surrogatepass"))
    if size > limits.max_grammar_bytes:
        raise LimitExceeded(field, f"{size} bytes", "max_grammar_bytes", limits.max_grammar_bytes)
    regexes, schemas = _scan(grammar)
    for line, pattern in regexes:
        try:
            limits.check_regex(pattern, field)
        except LimitExceeded as exc:
            raise LimitExceeded(field, f"the regex on line {line}: {exc.what}", exc.limit_name, exc.limit) from None
    for line, start, end in schemas:
        try:
            schema = json.loads(grammar[start:end])
        except RecursionError:
            raise LimitExceeded(field, f"the %json schema on line {line}: nesting depth over "
                                       f"{limits.max_schema_depth}", "max_schema_depth", limits.max_schema_depth) from None
        except ValueError:
            continue  # not JSON: the grammar library reports it when the grammar compiles
        try:
            limits.check_schema(schema, field)
        except LimitExceeded as exc:
            raise LimitExceeded(field, f"the %json schema on line {line}: {exc.what}", exc.limit_name,
                                exc.limit) from None


def grammar_regexes(grammar: str) -> list[tuple[int, str]]:
    """The ``/regex/`` literals of a Lark grammar with the line of each, as Lark reads them: outside ``"..."``
    strings, ``//`` comments and ``%json {...}`` schemas, from a ``/`` to the next one not escaped by a backslash
    (flags after it)."""
    return _scan(grammar)[0]


def grammar_json_schemas(grammar: str) -> list[tuple[int, int, int]]:
    """The ``%json {...}`` schemas of a Lark grammar (llguidance's extension): ``(line, start, end)`` of each
    object's text (``grammar[start:end]``)."""
    return _scan(grammar)[1]


def _json_object_end(text: str, i: int) -> int:
    """The index after the JSON object that starts at ``text[i] == "{"`` (braces counted outside JSON strings), or
    ``len(text)`` when it never closes."""
    depth, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return n


def _scan(grammar: str) -> tuple[list[tuple[int, str]], list[tuple[int, int, int]]]:
    """One walk over a Lark grammar: its ``/regex/`` literals (line, pattern) and its ``%json`` schemas
    (line, start, end)."""
    found: list[tuple[int, str]] = []
    schemas: list[tuple[int, int, int]] = []
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
        elif c == "%" and grammar.startswith("%json", i) and not grammar[i + 5:i + 6].isidentifier():
            start = i + 5
            while start < n and grammar[start].isspace():
                start += 1
            if start < n and grammar[start] == "{":
                end = _json_object_end(grammar, start)
                schemas.append((line, start, end))
                line += grammar.count("\n", i, end)
                i = end
                continue
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
    return found, schemas


def strict_json_whitespace(grammar: str) -> str:
    """``grammar`` with each ``%json`` schema compiled like the JSON kinds': no free whitespace between JSON tokens
    (``"x-guidance": {"whitespace_flexible": false}`` set in the schema, over what it says). Schemas that are not
    JSON objects are left for the grammar library to report."""
    schemas = grammar_json_schemas(grammar)
    if not schemas:
        return grammar
    parts, at = [], 0
    for _, start, end in schemas:
        try:
            schema = json.loads(grammar[start:end])
        except (ValueError, RecursionError):
            continue
        if not isinstance(schema, dict):
            continue
        options = schema.get("x-guidance")
        schema["x-guidance"] = {**(options if isinstance(options, dict) else {}), "whitespace_flexible": False}
        parts += [grammar[at:start], json.dumps(schema, ensure_ascii=False)]
        at = end
    return "".join(parts) + grammar[at:]


class GrammarScenario(ScenarioBase):
    """Constrain output to the sentences of a context-free grammar (field ``grammar``).

    The grammar is Lark text as llguidance reads it (``start: "yes" | "no" | NUMBER`` with ``NUMBER: /[0-9]+/``;
    its ``start`` rule is the whole output; ``/regex/`` terminals in Rust syntax; ``%ignore``, ``%import common``
    and llguidance's extensions as documented there). It is checked and built by the grammar library when the
    scenario compiles (a syntax error is a ``compile`` error naming ``grammar``); here only its size and its
    regexes are bounded (``limits.max_grammar_bytes``, ``max_regex_length``, ``max_regex_repeat``), and each
    ``%json {...}`` schema in it is held to the JSON-schema limits and, like the JSON kinds, allows no free
    whitespace between JSON tokens.
    """

    type: Literal["grammar"] = Field(description="Scenario kind.")
    grammar: str = Field(min_length=1, description="The Lark grammar the whole output must be a sentence of.")

    union_order: ClassVar[int] = 50
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
