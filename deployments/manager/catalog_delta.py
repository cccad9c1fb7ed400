"""Delta updates of stored scenarios (``PATCH /admin/scenarios/{name}``): items added to and removed from a tree
(any tree form: inline, file or catalog; the result is stored as a catalog), labels added to and removed from a
label set. :func:`apply_delta` is the manager's entry point (on a worker thread); it gives the whole new body and
a :class:`DeltaReport` of what changed.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from itertools import compress
from typing import Any

import numpy as np

from deployments.protocol import ServiceError

from .catalog import _RESERVED, Catalog, _bad, _line, catalog_body, check_items, items_from_tree

__all__ = ["DeltaReport", "apply_delta", "apply_labels_delta", "apply_tree_delta", "parse_delta"]


@dataclass
class DeltaReport:
    """What a PATCH did: counts, and the no-ops (adds already there, removes not there)."""

    added: int = 0
    removed: int = 0
    already_present: list[Any] = field(default_factory=list)
    not_present: list[Any] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per step of a tree PATCH (the manager's log)

    @property
    def changed(self) -> bool:
        return bool(self.added or self.removed)

    def applied(self, add: list[Any], remove: list[Any]) -> tuple[list[Any], list[Any]]:
        """``(added, removed)``: the items of ``add`` and ``remove`` this PATCH applied (the no-ops left out)."""
        present = {tuple(item) for item in self.already_present}
        absent = {tuple(item) for item in self.not_present}
        return ([item for item in add if tuple(item) not in present],
                [item for item in remove if tuple(item) not in absent])

    def to_json(self) -> dict[str, Any]:
        return {"added": self.added, "removed": self.removed, "already_present": self.already_present,
                "not_present": self.not_present}


def parse_delta(body: Any) -> tuple[list[Any], list[Any], int | None]:
    """``(add, remove, base_version)`` of a PATCH body ``{"add": [...], "remove": [...], "base_version": n}``
    (422 naming the field for anything else; at least one of add/remove)."""
    if not isinstance(body, dict):
        raise _bad("body: expected a JSON object {\"add\": [...], \"remove\": [...]}", "body")
    unknown = sorted(set(body) - {"add", "remove", "base_version"})
    if unknown:
        raise _bad(f"{unknown[0]}: unknown field (a PATCH body has add, remove and base_version)", unknown[0])
    add, remove = body.get("add", []), body.get("remove", [])
    for what, value in (("add", add), ("remove", remove)):
        if not isinstance(value, list):
            raise _bad(f"{what}: expected a JSON array, got {type(value).__name__}", what)
    if not add and not remove:
        raise _bad("add: a PATCH needs at least one item to add or remove", "add")
    base = body.get("base_version")
    if base is not None and (type(base) is not int or base < 1):
        raise _bad(f"base_version: expected a version number (an integer from 1), got {base!r}", "base_version")
    return add, remove, base


def _check_unique(values: list[Any], what: str) -> None:
    seen: dict[Any, int] = {}
    for i, value in enumerate(values):
        if value in seen:
            raise _bad(f"{what}[{i}]: repeats {what}[{seen[value]}]", what)
        seen[value] = i


def _check_disjoint(add: list[Any], remove: list[Any]) -> None:
    both = set(add) & set(remove)
    if both:
        first = next(i for i, value in enumerate(add) if value in both)
        raise _bad(f"add[{first}]: {json.dumps(add[first] if not isinstance(add[first], tuple) else list(add[first]))} "
                   "is also in remove; an item is either added or removed", "add")


def apply_labels_delta(body: dict[str, Any], add: list[Any], remove: list[Any]) -> tuple[dict[str, Any], DeltaReport]:
    """The labels scenario ``body`` with ``add`` appended and ``remove`` taken out (order kept)."""
    for what, values in (("add", add), ("remove", remove)):
        for i, value in enumerate(values):
            if not isinstance(value, str):
                raise _bad(f"{what}[{i}]: a label is a string, got {json.dumps(value)[:60]}", what)
        _check_unique(values, what)
    _check_disjoint(add, remove)
    labels = list(body.get("labels") or [])
    present = set(labels)
    report = DeltaReport()
    gone = set()
    for label in remove:
        if label in present:
            gone.add(label)
        else:
            report.not_present.append(label)
    kept = [label for label in labels if label not in gone]
    report.removed = len(gone)
    for label in add:
        if label in present:
            report.already_present.append(label)
        else:
            kept.append(label)
            report.added += 1
    return {**body, "labels": kept}, report


def _too_many_after_patch(count: int, limit: int) -> ServiceError:
    return ServiceError(422, f"add: the PATCH would give {count} items, over the limit max_tree_keys={limit} "
                             "(the limit of a catalog PUT)",
                        {"field": "add", "limit_name": "max_tree_keys", "limit": limit})


_CLASSES = 16  # rows are told apart by first id and length (capped) before their lines are compared


def _rows_of(catalog: Catalog, items: list[tuple[int, ...]]) -> dict[bytes, int]:
    """``{line: row}`` for the lines of ``items`` that ``catalog`` holds, without a Python test of every line or a
    set of them all (building one costs ~65 ms at 10^6 items, copying it for the result ~20 ms): array passes over
    ``flat`` / ``lengths`` keep the rows whose first id and length are those of one of ``items``, and only their
    lines (a few thousand for a 2,000-item delta) are looked at (~12 ms)."""
    flat, lengths, lines = catalog.flat, catalog.lengths, catalog.lines
    if not items:
        return {}
    if not flat.size:  # (only empty items)
        return {line: i for i, line in enumerate(lines)}
    starts = np.zeros(lengths.size, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    first = flat[np.minimum(starts, flat.size - 1)]  # (an empty row's is another row's: class 0 below)
    del starts
    code = np.where(lengths > 0, first, 0) * _CLASSES + np.minimum(lengths, _CLASSES - 1)
    wanted = np.array([(item[0] if item else 0) * _CLASSES + min(len(item), _CLASSES - 1) for item in items],
                      dtype=np.int64)
    return {lines[i]: i for i in np.flatnonzero(np.isin(code, wanted, kind="table")).tolist()}


def _cut_rows(catalog: Catalog, rows: list[int], extra: Catalog | None) -> tuple[list[bytes], np.ndarray, np.ndarray]:
    """``(lines, flat, lengths)`` of ``catalog`` less the rows ``rows`` (ascending), with ``extra``'s appended: each
    array written once, by slices between the removed rows (one filtering pass per array when they are many)."""
    lines, flat, lengths = catalog.lines, catalog.flat, catalog.lengths
    tail = [extra.flat] if extra else []
    if len(rows) * 16 > len(lines):
        keep = np.ones(len(lines), dtype=bool)
        keep[rows] = False
        lines = list(compress(lines, keep))
        flat = np.concatenate((flat[np.repeat(keep, lengths)], *tail))
    else:
        out: list[bytes] = []
        at = 0
        for i in rows:
            out += lines[at:i]
            at = i + 1
        out += lines[at:]
        lines = out
        ends = np.cumsum(lengths)[rows]  # where each removed row's ids end in flat, and start
        starts = ends - lengths[rows]
        flat = np.concatenate([flat[x:y] for x, y in zip([0, *ends.tolist()], [*starts.tolist(), flat.size])] + tail)
    lengths = np.delete(lengths, rows)
    if extra:
        lines.extend(extra.lines)  # (a list of this result's own)
        lengths = np.concatenate((lengths, extra.lengths))
    return lines, flat, lengths


def apply_tree_delta(catalog: Catalog, add: list[Any], remove: list[Any], *, vocab_size: int,
                     max_items: int | None = None, max_item_tokens: int | None = None) -> tuple[Catalog, DeltaReport]:
    """``catalog`` with the items ``add`` appended and ``remove`` taken out (order kept). A result of more than
    ``max_items`` items is a 422 naming ``max_tree_keys``, as a PUT of that catalog is; when the sizes alone show it
    (the result has at least ``len(add) - len(remove)`` items), before the items are checked. An added item longer
    than ``max_item_tokens`` is a 422 naming ``add[i]`` and ``max_item_tokens`` (removes are not bounded)."""
    if max_items is not None and len(add) - len(remove) > max_items:
        raise _too_many_after_patch(len(add) - len(remove), max_items)
    adds = check_items(add, end_token_id=catalog.end_token_id, vocab_size=vocab_size, where="add",
                       max_item_tokens=max_item_tokens)
    removes = check_items(remove, end_token_id=catalog.end_token_id, vocab_size=vocab_size, where="remove")
    _check_unique(adds, "add")
    _check_unique(removes, "remove")
    _check_disjoint(adds, removes)
    present = _rows_of(catalog, adds + removes)  # {line: row} of those the catalog holds
    report = DeltaReport()
    rows: list[int] = []
    for item in removes:
        row = present.get(_line(item))
        if row is not None:
            rows.append(row)
        else:
            report.not_present.append(list(item))
    new_items = []
    for item in adds:
        if _line(item) in present:
            report.already_present.append(list(item))
        else:
            new_items.append(item)
    report.removed, report.added = len(rows), len(new_items)
    rows.sort()
    lines, flat, lengths = catalog.lines, catalog.flat, catalog.lengths
    extra = Catalog.from_items(0, 0, new_items) if new_items else None
    if rows:  # the removed rows cut out, and the added ones appended
        lines, flat, lengths = _cut_rows(catalog, rows, extra)
    elif extra:
        lines = lines + extra.lines
        flat, lengths = np.concatenate((flat, extra.flat)), np.concatenate((lengths, extra.lengths))
    if max_items is not None and len(lines) > max_items:
        raise _too_many_after_patch(len(lines), max_items)
    result = Catalog(catalog.start_token_id, catalog.end_token_id, lines, flat, lengths, catalog.options)
    if catalog._content is not None:  # its bytes from the base's (else made from the lines when asked for)
        result._content, result._ends = _spliced_content(catalog, rows, extra.lines if extra else [])
    return result, report


def _spliced_content(base: Catalog, rows: list[int], added: list[bytes]) -> tuple[bytes, np.ndarray]:
    """``(content, line_ends)`` of ``base`` less its rows ``rows`` (ascending) with the lines ``added`` appended:
    the base's bytes between the removed lines, copied as they are (one copy of the bytes, no join of a million
    lines: ~0.02 s at 10^6 items instead of ~0.05-0.1 s, ~0.2 s at 10^7 instead of 1.7 s)."""
    data, ends = memoryview(base.content()), base.line_ends()
    head = len(base.header()) + 1
    starts = np.concatenate(([head], ends[:-1]))
    cut_from, cut_to = starts[rows].tolist(), ends[rows].tolist()
    pieces = [data[a:b] for a, b in zip([head, *cut_to], [*cut_from, len(data)]) if b > a]
    tail = b"".join(line + b"\n" for line in added)
    content = b"".join([data[:head], *pieces, tail])
    sizes = np.delete(ends - starts, rows)
    new_ends = np.empty(sizes.size + len(added), dtype=np.int64)
    np.cumsum(np.concatenate((sizes, np.fromiter(map(len, added), dtype=np.int64, count=len(added)) + 1)),
              out=new_ends)
    new_ends += head
    return content, new_ends


def apply_delta(compiler: Any, limits: Any, name: str, body: dict[str, Any] | None, add: list[Any], remove: list[Any],
                prepared: tuple[Catalog, Any] | None = None):
    """``(new body, content to store (bytes, a ``ContentDelta``) or None, report, sha of the content when its local
    copy is new)``: a PATCH's
    delta applied to a stored body (worker thread). ``compiler``: the manager's
    :class:`~deployments.manager.compiler.StoredScenarioCompiler` (validation, stored catalogs, content copies).
    ``prepared``: the current version's items and catalog tables when it is a tree given inline that the compiler
    has read already (``StoredScenarioCompiler.tree_base``; ``body`` is not needed then)."""
    from processors.kinds.tree.file import load_tree

    from processors import registry

    if prepared is not None:
        return _apply_tree(compiler, limits, name, body, add, remove, *prepared)
    assert body is not None
    kind = body.get("type")
    patch = registry.get(kind).capabilities.patch if kind in registry.names() else None
    if patch == "labels":
        new_body, report = apply_labels_delta(body, add, remove)
        return new_body, None, report, None
    if patch != "items":
        raise ServiceError(409, f"scenario {name!r} is a {kind} scenario: PATCH adds and removes tree items or "
                                "labels; PUT the whole scenario instead", {"name": name, "type": kind})
    sha = body.get("content_sha256")
    if body.get("content_format") == "items" and isinstance(sha, str):  # a stored catalog
        return _apply_tree(compiler, limits, name, body, add, remove, compiler.catalog(name, sha),
                           compiler.catalog_tables(sha), base_sha=sha)
    # an inline tree or a tree file: its items, once
    scenario = compiler.validate(name, body)
    tree = load_tree(scenario.tree if scenario.tree is not None else scenario.path, vocab_size=compiler.vocab_size)
    options = {k: v for k, v in body.items() if k not in _RESERVED}
    base = Catalog.from_items(int(tree.start_token_id), int(tree.end_token_id), items_from_tree(tree), options)
    return _apply_tree(compiler, limits, name, body, add, remove, base, None)


def _line_delta(add: list[Any], remove: list[Any], report: DeltaReport) -> bytes:
    """The stored form of a PATCH of a stored catalog (``store_content.line_delta``): the item lines it removed and
    those it appended, in the order ``apply_tree_delta`` applies them (the no-ops in ``report`` left out)."""
    from deployments.store_content import line_delta

    added, removed = report.applied(add, remove)
    return line_delta([_line(item) for item in removed], [_line(item) for item in added])


def _apply_tree(compiler: Any, limits: Any, name: str, body: Any, add: list[Any], remove: list[Any], base: Catalog,
                base_tables: Any, base_sha: str | None = None):
    """:func:`apply_delta` of a tree whose items (``base``) and, when built here lately, catalog tables
    (``base_tables``) are known. ``base_sha``: the base is stored catalog content under this hash; the result is
    then stored as the delta of it (``ContentDelta``: no whole catalog written, here or in Redis, unless the store
    compacts the chain), else as a whole catalog."""
    from deployments.store_content import ContentDelta

    t0 = time.perf_counter()
    catalog, report = apply_tree_delta(base, add, remove, vocab_size=compiler.vocab_size,
                                       max_items=limits.max_tree_keys, max_item_tokens=limits.max_item_tokens)
    t1 = time.perf_counter()
    if not report.changed:
        return body, None, report, None
    if not len(catalog):  # (not catalog.items: that makes a tuple per item)
        raise ServiceError(422, f"remove: the PATCH would leave scenario {name!r} without items; DELETE it instead",
                           {"name": name, "field": "remove"})
    content = catalog.content()
    if base_sha is not None:  # no local copy either: the catalog stays parsed in memory, Redis rebuilds the bytes
        sha, new = hashlib.sha256(content).hexdigest(), False
        stored: Any = ContentDelta(base_sha, _line_delta(add, remove, report), lambda: content)
    else:
        (sha, new), stored = compiler.keep_content(content), content
    compiler.remember_catalog(sha, catalog)
    t2 = time.perf_counter()
    # the base's tables updated along the changed paths (equal to a full compile), unless the delta is large for the
    # catalog: its Python work per touched path then costs more than a full compile's array passes. (Not on another
    # thread beside the bytes above: measured, the two together took longer than one after the other.)
    if base_tables is not None and (len(add) + len(remove)) * compiler.patch_states_per_item <= base_tables.n_states:
        from processors.kinds.tree.delta import patch_tables

        tables = patch_tables(base_tables, add, remove)
        if tables is not None:  # (None: the base's tables cannot tell their items; the compile builds them in full)
            compiler.remember_tables(sha, tables, patched=True)
    report.timings = {"items": t1 - t0, "bytes": t2 - t1, "tables": time.perf_counter() - t2}
    return catalog_body(catalog, content, sha), stored, report, (sha if new else None)
