"""What an error message repeats of a client's input: a field name or key, bounded.

A refusal names the field it refuses (``filter.stock.$gt``, ``metadata: item 3: field 'colour'``), and the field's
name is the client's text: a 100 KB key would come back whole in the message and again in the detail. Every
message and detail that repeats a client's field name or key shows it through :func:`shown_name`: whole up to
:data:`SHOWN_NAME_CHARS` characters, else its first ones, ``...`` and its length. A path of such names
(``a.b.0.c``) is :func:`shown_path`; a list of them, :func:`shown_names`: the first :data:`SHOWN_NAMES`, and how
many more there are. A library's message about the client's input (jsonschema's, which repeats the offending
value whole) is :func:`shown_message`: its first :data:`SHOWN_MESSAGE_CHARS` characters.

Example::

    >>> shown_name("stock")
    'stock'
    >>> shown_name("x" * 100_000)[-30:]
    'xxxxxxxx...(100000 characters)'
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["SHOWN_MESSAGE_CHARS", "SHOWN_NAMES", "SHOWN_NAME_CHARS", "shown_message", "shown_name", "shown_names",
           "shown_path"]

#: the most characters of one client-given name an error repeats
SHOWN_NAME_CHARS = 64
#: the most client-given names one error lists (the rest are counted)
SHOWN_NAMES = 20
#: the most characters of a library's message about the client's input an error repeats
SHOWN_MESSAGE_CHARS = 300


def shown_name(name: Any) -> str:
    """``name`` (a field name or key a client sent; not a string: its ``str``) as an error shows it: whole up to
    :data:`SHOWN_NAME_CHARS` characters, else its first :data:`SHOWN_NAME_CHARS`, ``...`` and its length
    (``"xxxx...(100000 characters)"``)."""
    text = name if isinstance(name, str) else str(name)
    if len(text) <= SHOWN_NAME_CHARS:
        return text
    return f"{text[:SHOWN_NAME_CHARS]}...({len(text)} characters)"


def shown_path(parts: Iterable[Any], sep: str = ".") -> str:
    """The parts of a location (keys, list indexes: pydantic's ``loc``) joined by ``sep``, each
    :func:`shown_name`."""
    return sep.join(shown_name(part) for part in parts)


def shown_message(text: str) -> str:
    """A library's message about the client's input, as an error repeats it: whole up to
    :data:`SHOWN_MESSAGE_CHARS` characters, else its first ones, ``...`` and its length."""
    if len(text) <= SHOWN_MESSAGE_CHARS:
        return text
    return f"{text[:SHOWN_MESSAGE_CHARS]}...({len(text)} characters)"


def shown_names(names: Sequence[Any]) -> tuple[list[str], str]:
    """The names an error lists (unknown fields, ...): ``(the first SHOWN_NAMES, each shown_name; the text that
    counts the rest: " (and 980 more)", or "")``."""
    shown = [shown_name(name) for name in names[:SHOWN_NAMES]]
    return shown, f" (and {len(names) - len(shown)} more)" if len(names) > len(shown) else ""
