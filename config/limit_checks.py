"""The limit checks the settings apply (``config/settings.py``: :class:`~config.settings.Limits`): the error a limit
raises (:class:`LimitExceeded`) and the measures it compares: JSON nesting depth, a regex's size with its
repetitions written out, the regexes inside a grammar and the patterns inside a JSON schema."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from itertools import chain
from typing import Any

from config.echo import shown_name

__all__ = ["LimitExceeded", "json_depth", "regex_repeat", "schema_patterns"]


class LimitExceeded(ValueError):
    """A request or scenario asks for more than a :class:`Limits` field allows.

    Attributes:
        field: the offending field (``labels``, ``schema``, ``tree.prefix_dict``, ...).
        limit_name: the ``Limits`` field that was exceeded (named in the message as ``name=value``).
        limit: that field's value.
        status: the HTTP status to answer with (413 for sizes of the request itself, else 422).
    """

    def __init__(self, field: str, what: str, limit_name: str, limit: int | float, status: int = 422):
        self.field, self.what, self.limit_name, self.limit, self.status = field, what, limit_name, limit, status
        super().__init__(f"{field}: {self.reason}")

    @property
    def reason(self) -> str:
        """The message without the field: ``"5 labels exceeds the limit max_labels=4"``."""
        return f"{self.what} exceeds the limit {self.limit_name}={self.limit}"

    def __reduce__(self):  # keep the fields when pickled across Ray processes
        return (type(self), (self.field, self.what, self.limit_name, self.limit, self.status))

    def detail(self) -> dict[str, Any]:
        """Structured detail for an error body."""
        return {"field": self.field, "limit_name": self.limit_name, "limit": self.limit}


def json_depth(value: Any, stop_at: int | None = None) -> int:
    """Nesting depth of a JSON-like value (a scalar is 0, ``[]`` and ``{}`` are 1, ``[[1]]`` is 2).

    Iterative, so a value nested deeper than Python's recursion limit is measured too; stops early once
    the depth passes ``stop_at``.
    """
    deepest = 0
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        if stop_at is not None and deepest > stop_at:
            break
        children = item.values() if isinstance(item, dict) else item
        if _flat_lists(children):  # e.g. a tree's prefix_dict: lists of scalars, checked at C speed
            deepest = max(deepest, level + 1)
            continue
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def _flat_lists(children: Any) -> bool:
    """Whether ``children`` are many lists holding no dict or list (then they add one level and need no walk)."""
    if len(children) < 64 or set(map(type, children)) != {list}:
        return False
    return not set(map(type, chain.from_iterable(children))) & {dict, list}


_COUNTED = re.compile(r"\{\s*(\d+)\s*(?:(,)\s*(\d*)\s*)?\}")
_HUGE = 10**18
_BRACED_ESCAPES = frozenset("pPxuU")  # \p{L}, \x{10FFFF}, ...: braces that are not a repetition


def regex_repeat(pattern: str) -> int:
    """The size of ``pattern`` with every counted repetition written out: ``{n,m}`` repeats what it applies
    to ``m`` times (``n`` when open), sequential pieces add up, nested repetitions multiply, each branch of
    an alternation counts, and every other atom (a character, a class, an escape) is 1; ``*``, ``+`` and
    ``?`` add nothing. ``[0-9]{3}-[0-9]{4}`` gives 8, ``(a{100}){100}`` 10000, ``"(a{10000})" * 400``
    4000000, ``a+`` 1.

    A grammar engine expands counted repetitions into that many copies, so this is the measure of a
    regex's size that its length does not show (``a{1000000}`` is 10 characters). Syntax errors are
    left to the regex engine: this only scans.
    """
    # Per open group: [size of the finished alternation branches, size of the current branch].
    frames: list[list[int]] = [[0, 0]]
    last = 0  # size of the atom or group just read (what a quantifier would apply to); 0: none
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            if i - 1 < n and pattern[i - 1] in _BRACED_ESCAPES and i < n and pattern[i] == "{":
                close = pattern.find("}", i)
                i = n if close < 0 else close + 1
            last = 1
            frames[-1][1] += 1
        elif c == "[":  # a class, possibly with nested classes ([a-z&&[^aeiou]], [[:alpha:]])
            depth, i = 1, i + 1
            if i < n and pattern[i] == "^":
                i += 1
            if i < n and pattern[i] == "]":  # a leading ']' is a literal
                i += 1
            while i < n and depth:
                if pattern[i] == "\\":
                    i += 1
                elif pattern[i] == "[":
                    depth += 1
                elif pattern[i] == "]":
                    depth -= 1
                i += 1
            last = 1
            frames[-1][1] += 1
        elif c == "(":
            frames.append([0, 0])
            last, i = 0, i + 1
        elif c == ")":
            if len(frames) > 1:
                done, branch = frames.pop()
                last = min(done + branch, _HUGE)
            else:  # an unbalanced ')': a literal to this scan
                last = 1
            frames[-1][1] = min(frames[-1][1] + last, _HUGE)
            i += 1
        elif c == "{" and last and (match := _COUNTED.match(pattern, i)):
            low, comma, high = match.groups()
            digits = high if comma and high else low
            bound = int(digits) if len(digits) <= 18 else _HUGE  # int() refuses very long digit strings
            grown = min(last * max(bound, 1), _HUGE)
            frames[-1][1] = min(frames[-1][1] - last + grown, _HUGE)
            last = grown
            i = match.end()
        elif c == "|":
            frames[-1][0] = min(frames[-1][0] + frames[-1][1], _HUGE)
            frames[-1][1] = 0
            last, i = 0, i + 1
        elif c in "*+?":
            i += 1
        else:
            last, i = 1, i + 1
            frames[-1][1] += 1
    total = 0
    for done, branch in frames:  # unclosed groups count too
        total += done + branch
    return min(total, _HUGE)


def schema_patterns(schema: Any, field: str = "schema"):
    """The regexes of a JSON schema with the JSON path of each: every ``pattern`` keyword, every key of a
    ``patternProperties`` (``propertyNames`` is a schema: its ``pattern`` is found like any other).

    Values of ``const``, ``enum``, ``default`` and ``examples`` are data, not schemas, and are skipped;
    so are the names under ``properties``, ``$defs`` and the like (a property may be called ``pattern``).
    Iterative, so a deep schema is walked without recursion.
    """
    stack: list[tuple[Any, str]] = [(schema, field)]
    while stack:
        node, path = stack.pop()
        if isinstance(node, list):
            stack.extend((item, f"{path}[{index}]") for index, item in reversed(list(enumerate(node))))
            continue
        if not isinstance(node, Mapping):
            continue
        children = []
        for key, value in node.items():
            if key in _SCHEMA_DATA:
                continue
            where = _child(path, key)
            if key == "pattern":
                if isinstance(value, str):
                    yield where, value
                else:
                    children.append((value, where))
            elif key in _SCHEMA_MAPS and isinstance(value, Mapping):
                for name, sub in value.items():
                    sub_path = _child(where, name)
                    if key == "patternProperties" and isinstance(name, str):
                        yield f"{where}[{json.dumps(shown_name(name))}]", name
                    children.append((sub, sub_path))
            elif isinstance(value, (Mapping, list)):
                children.append((value, where))
        stack.extend(reversed(children))


def _child(path: str, key: Any) -> str:
    """The path of ``key`` under ``path`` (``a.b``, or ``a["b c"]`` for a key that is not a plain name), the key
    shown bounded (:func:`config.echo.shown_name`)."""
    shown = shown_name(key)
    return f"{path}.{shown}" if _PLAIN_KEY.fullmatch(shown) else f"{path}[{json.dumps(shown)}]"


_SCHEMA_DATA = frozenset({"const", "enum", "default", "examples"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_PLAIN_KEY = re.compile(r"[A-Za-z_$][A-Za-z0-9_$]*")
