"""Strict JSON for request bodies: what Python's ``json`` module accepts but a body must not hold.

:func:`parse_json` parses like ``json.loads`` and refuses, naming the field by its dotted path
(``messages.0.content``, ``tree.prefix_dict``):

* non-finite numbers: the ``NaN``, ``Infinity`` and ``-Infinity`` literals (not JSON, but ``json.loads`` takes
  them) and numbers that overflow to infinity (``1e999``);
* integers of more than ``sys.get_int_max_str_digits()`` digits (4300), which ``json.loads`` refuses with a
  bare ``ValueError``;
* strings (values or keys) holding a lone UTF-16 surrogate (``"\\ud800"``, or its bytes in the body): not
  Unicode text, they break the tokenizer and the Redis encoding;
* an object that gives a key twice (``json.loads`` keeps the last silently; the tree-file loader reports it).

A key in a path or a message is shown bounded (:func:`config.echo.shown_name`).

Invalid JSON and bodies nested deeper than the parser can go are left to the caller (``json.JSONDecodeError`` and
``RecursionError`` as from ``json.loads``), so their existing errors stay as they were.

The ingress applies it to every request body (``deployments/json_body.py:StrictJSONBody``), the manager to a
catalog's header line.

Example::

    >>> parse_json(b'{"temperature": 0.5}')
    {'temperature': 0.5}
    >>> try:
    ...     parse_json(b'{"messages": [{"content": "ok"}, {"temperature": NaN}]}')
    ... except BodyRejected as error:
    ...     print(error)
    messages.1.temperature: NaN is not a finite number (give a finite number)
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from typing import Any, Callable

from config.echo import shown_name

__all__ = ["BodyRejected", "parse_json"]

#: a ``\uXXXX`` escape of a surrogate code point (D800-DFFF) in JSON text; a pair is fine, the walk tells
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE_ESCAPE_STR = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


class BodyRejected(ValueError):
    """A body breaks a rule of :func:`parse_json`; ``field`` is the dotted path, the message starts with it."""

    def __init__(self, field: str, reason: str):
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")

    def __reduce__(self):
        return (type(self), (self.field, self.reason))


class _Bad:
    """Stands where a refused number was, until the walk finds its path."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


class _Duplicates(dict):
    """An object that gave some key more than once (``counts``: key -> times)."""

    __slots__ = ("counts",)

    counts: dict[str, int]


class _Parse:
    """The hooks of one parse; ``suspect`` says whether the result needs the walk."""

    def __init__(self) -> None:
        self.suspect = False

    def constant(self, name: str) -> _Bad:
        self.suspect = True
        return _Bad(f"{name} is not a finite number (give a finite number)")

    def float_(self, text: str) -> float | _Bad:
        value = float(text)
        if value - value != 0.0:  # inf (nan cannot come from a JSON number)
            self.suspect = True
            shown = text if len(text) <= 24 else text[:12] + "..." + text[-6:]
            return _Bad(f"{shown} overflows to infinity, not a finite number (give a finite number)")
        return value

    def int_(self, text: str) -> int | _Bad:
        digits = len(text.lstrip("-"))
        limit = sys.get_int_max_str_digits()
        if limit and digits > limit:
            self.suspect = True
            return _Bad(f"an integer of {digits} digits is too long (at most {limit} digits)")
        return int(text)

    def object_(self, pairs: list[tuple[str, Any]]) -> dict:
        value = dict(pairs)
        if len(value) != len(pairs):
            self.suspect = True
            counts = Counter(key for key, _ in pairs)
            duplicates = _Duplicates(value)
            duplicates.counts = {key: n for key, n in counts.items() if n > 1}
            return duplicates
        return value


def _loads(text: bytes | str, hooks: _Parse, parse_int: Callable[[str], Any] | None) -> Any:
    return json.loads(text, parse_constant=hooks.constant, parse_float=hooks.float_, parse_int=parse_int,
                      object_pairs_hook=hooks.object_)


def _join(path: str, part: Any) -> str:
    return f"{path}.{shown_name(part)}" if path else shown_name(part)


def _surrogate_reason(text: str, what: str) -> str:
    match = _SURROGATE.search(text)
    assert match is not None  # (called for a text that holds one)
    return (f"{what} holds a lone surrogate (\\u{ord(match.group()):04x}) at character {match.start()}: "
            "not valid Unicode text")


def _first_problem(value: Any, field: str) -> BodyRejected | None:
    """The first refused item in document order, named by its path (iterative: no recursion limit)."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        where = path or field
        if isinstance(item, _Bad):
            return BodyRejected(where, item.reason)
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return BodyRejected(where, _surrogate_reason(item, "the text"))
        elif isinstance(item, dict):
            if isinstance(item, _Duplicates):
                key, times = next(iter(item.counts.items()))
                return BodyRejected(where, f"duplicate key {json.dumps(shown_name(key))} (appears {times} times; give "
                                           "each key once)")
            for key in item:
                if _SURROGATE.search(key):
                    return BodyRejected(where, _surrogate_reason(key, f"a key ({shown_name(key)!r})"))
            stack.extend((child, _join(path, key)) for key, child in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((child, _join(path, i)) for i, child in reversed(list(enumerate(item))))
    return None


def _may_hold_surrogates(text: bytes | str) -> bool:
    if isinstance(text, str):
        return bool(_SURROGATE.search(text) or _SURROGATE_ESCAPE_STR.search(text))
    if _SURROGATE_ESCAPE.search(text):
        return True
    try:
        text.decode("utf-8")
    except UnicodeDecodeError:  # json.loads decodes with 'surrogatepass' (or the body is UTF-16/32)
        return True
    return False


def parse_json(text: bytes | str, field: str = "body") -> Any:
    """``json.loads(text)``, refusing what the module docstring lists with :class:`BodyRejected`.

    ``field`` names the text itself; paths inside it are appended (``field`` is dropped for a whole body,
    kept as a prefix otherwise: ``structured_outputs.json.minimum``).

    Raises:
        BodyRejected: naming the first offending field.
        json.JSONDecodeError, UnicodeDecodeError: not JSON (as ``json.loads``).
        RecursionError: nested deeper than the parser can go (as ``json.loads``).
    """
    hooks = _Parse()
    try:
        value = _loads(text, hooks, None)
    except json.JSONDecodeError:
        raise
    except ValueError as error:  # int(): "Exceeds the limit (4300 digits) for integer string conversion"
        if "integer string conversion" not in str(error):
            raise
        hooks = _Parse()
        value = _loads(text, hooks, hooks.int_)
    if hooks.suspect or _may_hold_surrogates(text):
        problem = _first_problem(value, field)
        if problem is not None:
            if field != "body" and problem.field != field:
                problem = BodyRejected(f"{field}.{problem.field}", problem.reason)
            raise problem
    return value
