"""A request's ``filter`` over item metadata (:mod:`processors.kinds.tree.filters.metadata`), in the vector databases' filter language
(Pinecone, Chroma): ``{"region": {"$in": ["eu"]}, "stock": {"$gt": 0}}``.

* A field's condition is a value (``$eq`` of it) or an object of operators, all of which must hold: ``$eq $ne $in
  $nin $contains $not_contains`` (categorical and numeric fields), ``$gt $gte $lt $lte`` (numeric fields). Fields
  side by side must all hold (implicit AND); ``$and`` / ``$or`` take a list of filters.
* A list field (an item's list of strings) matches ``$eq`` / ``$in`` when any of its strings is a value; ``$ne`` /
  ``$nin`` when none is (Pinecone's rule). ``$contains`` / ``$not_contains`` (Chroma's names for a list field) take
  one value and are ``$eq`` / ``$ne`` of it: the list holds it / does not; an item whose field is one value is a list
  of that one value (it contains what it equals).
* An item without the field fails ``$eq $in $contains $gt $gte $lt $lte`` and passes ``$ne $nin $not_contains``.

:func:`parse_filter` checks a filter against the catalog's fields (a 422 naming the field: an unknown field or
operator, a value of the wrong kind, bounds on size and depth; a name the client gave is repeated bounded,
:func:`config.echo.shown_name`) into a :class:`Filter`; :meth:`Filter.mask` gives the items that pass (a boolean
per item, numpy passes over the columns, no Python per item).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from config import ConstraintError
from config.echo import shown_name

from processors.kinds.tree.filters.metadata import CATEGORICAL, NUMERIC, Column, ItemMetadata

__all__ = ["Filter", "FilterLimits", "filter_limits", "parse_filter"]

EQUALITY = ("$eq", "$ne", "$in", "$nin")
#: Chroma's operators of a list field, read as the equality they are (see the module docstring)
CONTAINS = {"$contains": "$eq", "$not_contains": "$ne"}
RANGE = ("$gt", "$gte", "$lt", "$lte")
LOGICAL = ("$and", "$or")


@dataclass(frozen=True)
class FilterLimits:
    """Bounds of one filter, checked while it is read (a 422 naming the limit)."""

    max_clauses: int = 64
    max_depth: int = 8
    max_values: int = 1024  # entries of one $in / $nin


def filter_limits(limits: Any) -> FilterLimits:
    """The service's bounds of a filter (``limits.max_filter_clauses``, ``limits.max_filter_depth``,
    ``limits.max_filter_values`` when set), else the defaults."""
    default = FilterLimits()
    return FilterLimits(int(getattr(limits, "max_filter_clauses", default.max_clauses)),
                        int(getattr(limits, "max_filter_depth", default.max_depth)),
                        int(getattr(limits, "max_filter_values", default.max_values)))


def _refused(path: str, message: str, **detail: Any) -> ConstraintError:
    return ConstraintError(422, f"{path}: {message}", {"field": path, **detail})


@dataclass(frozen=True)
class _Clause:
    column: Column
    op: str
    value: Any  # a scalar, or a tuple for $in / $nin


@dataclass(frozen=True)
class Filter:
    """A checked filter: ``("and" | "or", parts)`` trees of field clauses."""

    op: str
    parts: tuple["Filter | _Clause", ...]

    def mask(self, metadata: ItemMetadata) -> np.ndarray:
        """A boolean per item: ``True`` where the item passes."""
        return _mask(self, metadata.n)


def _mask(node: "Filter | _Clause", n: int) -> np.ndarray:
    if isinstance(node, _Clause):
        return _clause_mask(node, n)
    out: np.ndarray | None = None
    for part in node.parts:
        m = _mask(part, n)
        if out is None:
            out = m
        elif node.op == "and":
            out &= m
        else:
            out |= m
    return out if out is not None else np.ones(n, dtype=bool)


def _clause_mask(clause: _Clause, n: int) -> np.ndarray:
    col, op, value = clause.column, clause.op, clause.value
    if col.kind == NUMERIC:
        x = col.numbers
        assert x is not None
        if op == "$eq":
            return x == value
        if op == "$ne":
            return ~(x == value)  # missing (NaN) passes
        if op == "$in":
            return np.isin(x, np.asarray(value, dtype=np.float64))
        if op == "$nin":
            return ~np.isin(x, np.asarray(value, dtype=np.float64))
        return {"$gt": np.greater, "$gte": np.greater_equal, "$lt": np.less, "$lte": np.less_equal}[op](x, value)
    wanted = [c for c in (col.code(v) for v in (value if op in ("$in", "$nin") else (value,))) if c >= 0]
    assert col.codes is not None
    if not col.is_list:
        hit = np.isin(col.codes, wanted) if len(wanted) != 1 else col.codes == wanted[0]
    else:
        entries = np.isin(col.codes, wanted)
        hit = np.zeros(n, dtype=bool)
        hit[col.rows()[entries]] = True
    return hit if op in ("$eq", "$in") else ~hit


class _Reader:
    def __init__(self, metadata: ItemMetadata, limits: FilterLimits, root: str):
        self.metadata, self.limits, self.root = metadata, limits, root
        self.clauses = 0

    def read(self, value: Any, path: str, depth: int) -> Filter:
        if depth > self.limits.max_depth:
            raise _refused(path, f"nested deeper than the limit max_filter_depth={self.limits.max_depth}",
                           limit_name="max_filter_depth", limit=self.limits.max_depth)
        if not isinstance(value, dict):
            raise _refused(path, f"expected an object, got {type(value).__name__}")
        parts: list[Filter | _Clause] = []
        for key, sub in value.items():
            where = f"{path}.{shown_name(key)}"
            if key in LOGICAL:
                if not isinstance(sub, list) or not sub:
                    raise _refused(where, "expected a non-empty list of filters")
                if len(sub) > self.limits.max_clauses:
                    raise self._too_many(where)
                parts.append(Filter(key[1:], tuple(self.read(f, f"{where}[{i}]", depth + 1)
                                                   for i, f in enumerate(sub))))
            elif isinstance(key, str) and key.startswith("$"):
                raise _refused(where, f"unknown operator {shown_name(key)!r} at this level (fields, $and, $or)")
            else:
                parts.extend(self.field(key, sub, where))
        if not parts:
            raise _refused(path, "an empty filter (name a field, $and or $or)")
        return Filter("and", tuple(parts))

    def _too_many(self, where: str) -> ConstraintError:
        return _refused(where, f"over the limit max_filter_clauses={self.limits.max_clauses}",
                        limit_name="max_filter_clauses", limit=self.limits.max_clauses)

    def field(self, name: str, condition: Any, where: str) -> list[_Clause]:
        column = self.metadata.columns.get(name)
        if column is None:
            known = ", ".join(sorted(self.metadata.columns)) or "none"
            raise _refused(where, f"unknown metadata field {shown_name(name)!r} (the catalog's fields: {known})",
                           name=shown_name(name))
        ops = condition if isinstance(condition, dict) else {"$eq": condition}
        if not ops:
            raise _refused(where, "an empty condition")
        out = []
        for op, value in ops.items():
            self.clauses += 1
            if self.clauses > self.limits.max_clauses:
                raise self._too_many(where)
            at = f"{where}.{shown_name(op)}" if op != "$eq" or isinstance(condition, dict) else where
            out.append(_Clause(column, CONTAINS.get(op, op), self.value(column, op, value, at)))
        return out

    def value(self, column: Column, op: str, value: Any, where: str) -> Any:
        if op not in EQUALITY + RANGE and op not in CONTAINS:
            raise _refused(where, f"unknown operator {shown_name(op)!r} (one of "
                                  f"{', '.join((*EQUALITY, *CONTAINS, *RANGE))})")
        if op in CONTAINS and isinstance(value, list):
            raise _refused(where, f"{op} takes one value (the list field holds it or not); $in / $nin take a list")
        if op in RANGE and column.kind != NUMERIC:
            raise _refused(where, f"{op} compares numbers; field {column.name!r} is {column.kind}", name=column.name)
        if op in ("$in", "$nin"):
            if not isinstance(value, list) or not value:
                raise _refused(where, "expected a non-empty list of values")
            if len(value) > self.limits.max_values:
                raise _refused(where, f"{len(value)} values, over the limit max_filter_values={self.limits.max_values}",
                               limit_name="max_filter_values", limit=self.limits.max_values)
            return tuple(self.scalar(column, v, where) for v in value)
        return self.scalar(column, value, where)

    def scalar(self, column: Column, value: Any, where: str) -> Any:
        if column.kind == NUMERIC:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
                got = ("an integer past the largest float (about 1.8e308)"
                       if isinstance(value, int) and not isinstance(value, bool) else type(value).__name__)
                raise _refused(where, f"field {column.name!r} is numeric: compare it with a finite number, got {got}",
                               name=column.name)
            return float(value)
        assert column.kind == CATEGORICAL
        if not isinstance(value, (str, bool)):
            raise _refused(where, f"field {column.name!r} is categorical: compare it with a string or a boolean, got "
                                  f"{type(value).__name__}", name=column.name)
        return value


def _finite(value: int | float) -> bool:
    """Whether ``value`` is a finite float: an integer past the largest float (a JSON number of 400 digits) is
    not (``math.isfinite`` raises ``OverflowError`` on it)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def parse_filter(value: Any, metadata: ItemMetadata | None, limits: FilterLimits = FilterLimits(),
                 path: str = "filter") -> Filter:
    """A request's ``filter`` checked against the catalog's metadata (a 422 naming the field on anything wrong)."""
    if metadata is None or not metadata.columns:
        raise _refused(path, "the scenario's items carry no metadata to filter on")
    return _Reader(metadata, limits, path).read(value, path, 1)
