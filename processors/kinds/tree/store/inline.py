"""Large inline trees read once: a tree scenario's PUT body split into its ``tree`` and the rest, without parsing
the tree as Python objects.

A tree sent inline (``{"type": "tree", "tree": {"prefix_dict": {...}}}``) used to be parsed three times on its way
to the tables: the strict JSON parse of the body, pydantic over every entry of ``prefix_dict``, and the tree
loader's own checks; at 10^6 keys that was about 5 s of the manager's CPU per PUT, nearly all of the swap. Here
the body's bytes are cut at the tree's braces (:func:`config.json_span.object_field_span`): the few fields
around it get the strict parse and the scenario model as before, and the tree's text goes to the tree loader's
numpy scan, the same reader as a tree file's (every rule checked once, there). The body is stored as the text the
client sent, so a GET gives back the tree it was given.

Only a split that is certain is taken (no backslash anywhere, one top-level ``tree`` object, the rest a valid
scenario object); anything else, and any refusal on this way, goes the exact way
(the config manager's compile of the whole body), which names the problem as for any
inline tree.

Part of the tree kind's stored content (:class:`processors.kinds.tree.store.content.TreeContent`): the config manager hands a large PUT body to
its kinds' content (:meth:`~processors.kinds.base.ConstraintKind.stored_content`) before parsing it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable

from config.json_span import object_field_span

__all__ = ["INLINE_TREE_MIN_BYTES", "InlineTree", "split_inline_tree"]

# Bodies smaller than this are parsed whole: the split saves nothing worth a second way at their size.
INLINE_TREE_MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class InlineTree:
    """A tree scenario's PUT body, split.

    Attributes:
        rest: the body's other fields, strictly parsed (``tree`` is ``None`` there).
        tree: the JSON text of the ``tree`` object.
        json: the whole body as received, checked to be UTF-8 (what the store keeps).
    """

    rest: dict[str, Any]
    tree: bytes
    json: bytes

    def fingerprint_body(self) -> dict[str, Any]:
        """What an ``Idempotency-Key`` is bound to: the other fields and the tree's SHA-256 (the same bytes split
        the same way, so a retry of the same request matches)."""
        return {**self.rest, "tree": {"sha256": hashlib.sha256(self.tree).hexdigest()}}


def split_inline_tree(raw: bytes, parse_body: Callable[[bytes], dict[str, Any]], *,
                      min_bytes: int = INLINE_TREE_MIN_BYTES) -> InlineTree | None:
    """``raw`` (a PUT body) as an :class:`InlineTree`, or ``None`` when it is to be parsed whole: smaller than
    ``min_bytes``, no single top-level ``tree`` object found cheaply, the rest not a valid JSON object
    (``parse_body``: the strict parse of a scenario body within the limits; any exception refuses), not a tree
    scenario, or a body that also names a ``path`` or stored content (the exact way refuses those, naming the
    field)."""
    if len(raw) < min_bytes:
        return None
    span = object_field_span(raw, "tree")
    if span is None:
        return None
    start, end = span
    try:
        rest = parse_body(raw[:start] + b"null" + raw[end:])
        raw.decode("utf-8")  # the tree's text is checked by its scan; the store keeps the whole body as UTF-8
    except Exception:  # noqa: BLE001 - any refusal: the exact way parses the whole body and names it
        return None
    if (rest.get("type") != "tree" or "tree" not in rest or rest["tree"] is not None
            or any(field in rest for field in ("path", "content_sha256", "content_format"))):
        return None
    return InlineTree(rest, raw[start:end], raw)
