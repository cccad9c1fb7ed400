"""Where a top-level field's object value lies in a JSON body, found with array passes (the config manager cuts a
large inline tree out of its PUT body this way: ``processors/kinds/tree/store/inline.py``)."""

from __future__ import annotations

import re

import numpy as np

__all__ = ["object_field_span"]


_KEY_BEFORE = re.compile(rb'"([^"\\]*)"[ \t\n\r]*:[ \t\n\r]*\Z')
_KEY_LOOKBACK = 4096  # a top-level key longer than this is not looked for (the caller parses the body instead)


def object_field_span(raw: bytes, field: str) -> tuple[int, int] | None:
    """Where the value of the top-level field ``field`` of the JSON object ``raw`` lies, as ``(start, end)`` byte
    offsets (``raw[start:end]`` is that value, from its ``{`` to its ``}``), found with array passes; ``None``
    when it cannot be told cheaply: a backslash anywhere (strings with escapes), brackets that do not balance,
    ``raw`` not one object, the field absent, given twice, or not an object.

    A ``Some`` answer does not make ``raw`` valid JSON: the caller parses what is outside the span and the
    value itself (:func:`processors.kinds.tree.treefile.scan.scan_tree_bytes`), each strictly. Quotes are paired in order (no escapes), so a
    bracket is inside a string exactly when an odd number of quotes precede it."""
    a = np.frombuffer(raw, dtype=np.uint8)
    if not a.size or np.count_nonzero(a == 0x5C):
        return None
    quotes = np.flatnonzero(a == 0x22)
    if quotes.size % 2:
        return None
    brackets = np.flatnonzero((a == 0x7B) | (a == 0x7D) | (a == 0x5B) | (a == 0x5D))
    brackets = brackets[np.searchsorted(quotes, brackets) % 2 == 0]  # those outside strings
    if not brackets.size:
        return None
    kind = a[brackets]
    opening = (kind == 0x7B) | (kind == 0x5B)
    depth = np.cumsum(np.where(opening, 1, -1))  # after each bracket
    if kind[0] != 0x7B or depth.min() < 0 or np.flatnonzero(depth == 0).tolist() != [brackets.size - 1]:
        return None
    closers = np.flatnonzero(depth == 1)
    found = None
    for i in np.flatnonzero(opening & (depth == 2)).tolist():  # the top-level fields' containers: a few
        start = int(brackets[i])
        match = _KEY_BEFORE.search(raw, max(0, start - _KEY_LOOKBACK), start)
        if match is None:
            return None
        if match.group(1) != field.encode():
            continue
        j = int(closers[np.searchsorted(closers, i)])
        if found is not None or kind[i] != 0x7B or kind[j] != 0x7D:
            return None
        found = (start, int(brackets[j]) + 1)
    return found
