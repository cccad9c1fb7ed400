"""Item metadata of a catalog, by column: what a request's ``filter`` is evaluated on (:mod:`processors.kinds.tree.filters.language`).

Each item may carry metadata: a field is *categorical* (a string or a boolean, or a list of strings: an item
matches a value when any of its strings is that value) or *numeric* (an int or a float). One field has one kind
across the catalog; an item may leave a field out (it is then *missing* there: see :mod:`processors.kinds.tree.filters.language` for what a
missing field passes).

Stored by column, one entry per item in the catalog's order:

* categorical, one value: ``codes`` (``int32``, ``-1`` where missing) into the field's sorted ``values``;
* categorical, a list: ``codes`` of every item's strings one after the other and ``offsets`` (``int64``, items + 1);
* numeric: ``numbers`` (``float64``, NaN where missing; integers are exact up to 2^53).

:class:`ItemMetadata` is built from the items' metadata objects (:meth:`ItemMetadata.from_objects`) with the limits
checked first: fields, distinct values per field, bytes of one item's metadata.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from config import ConstraintError
from config.echo import shown_name

__all__ = ["CATEGORICAL", "NUMERIC", "Column", "ItemMetadata", "MetadataLimits"]

CATEGORICAL = "categorical"
NUMERIC = "numeric"
#: the most frequent values GET shows of a categorical field (with their item counts)
SUMMARY_VALUES = 20
#: the largest integer a numeric field keeps exactly (float64)
EXACT_INT = 2 ** 53


@dataclass(frozen=True)
class MetadataLimits:
    """Bounds of a catalog's metadata, checked before anything is built (a 422 naming the limit)."""

    max_fields: int = 32
    max_values_per_field: int = 100_000
    max_item_bytes: int = 4096
    max_list_length: int = 64
    max_name_length: int = 64


def _refused(message: str, limit_name: str | None = None, limit: int | None = None, **detail: Any) -> ConstraintError:
    extra = {"limit_name": limit_name, "limit": limit} if limit_name else {}
    return ConstraintError(422, f"metadata: {message}", {"field": "metadata", **extra, **detail})


@dataclass
class Column:
    """One metadata field over the catalog's items (see the module docstring for the arrays)."""

    name: str
    kind: str
    values: tuple[Any, ...] = ()  # categorical: the distinct values, sorted (booleans first, then strings)
    codes: np.ndarray | None = None
    offsets: np.ndarray | None = None  # categorical lists only
    listed: np.ndarray | None = None  # categorical lists only: bool per item, the item gave a list (maybe empty)
    numbers: np.ndarray | None = None
    _index: dict[Any, int] = field(default_factory=dict, repr=False)
    _rows: np.ndarray | None = field(default=None, repr=False)

    @property
    def is_list(self) -> bool:
        return self.offsets is not None

    def code(self, value: Any) -> int:
        """The code of a categorical value, ``-1`` when no item has it."""
        if not self._index:
            self._index = {_value_key(v): i for i, v in enumerate(self.values)}
        return self._index.get(_value_key(value), -1)

    def rows(self) -> np.ndarray:
        """For a list column: the item of each entry of ``codes``."""
        if self._rows is None:
            assert self.offsets is not None
            self._rows = np.repeat(np.arange(self.offsets.size - 1, dtype=np.int64), np.diff(self.offsets))
        return self._rows

    def summary(self) -> dict[str, Any]:
        """What GET shows of the field: its kind, how many items have it, and its distinct values with the item
        counts of the most frequent (categorical) or its range (numeric)."""
        if self.kind == NUMERIC:
            assert self.numbers is not None
            present = self.numbers[~np.isnan(self.numbers)]
            out: dict[str, Any] = {"kind": NUMERIC, "items": int(present.size)}
            if present.size:
                out.update(min=_number(present.min()), max=_number(present.max()))
            return out
        assert self.codes is not None
        counts = np.bincount(self.codes[self.codes >= 0], minlength=len(self.values))
        items = (int(np.count_nonzero(np.diff(self.offsets))) if self.offsets is not None
                 else int(np.count_nonzero(self.codes >= 0)))
        top = np.argsort(-counts, kind="stable")[:SUMMARY_VALUES]
        return {"kind": CATEGORICAL, "list": self.is_list, "items": items, "distinct_values": len(self.values),
                "values": {str(self.values[i]).lower() if isinstance(self.values[i], bool) else self.values[i]:
                           int(counts[i]) for i in top}}


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() and abs(x) < EXACT_INT else float(x)


def _value_key(value: Any) -> tuple[int, Any]:
    """Booleans and strings kept apart (``True == 1`` in Python)."""
    return (0, value) if isinstance(value, bool) else (1, value)


class ItemMetadata:
    """The metadata columns of ``n`` items (see the module docstring)."""

    def __init__(self, n: int, columns: dict[str, Column]):
        self.n = n
        self.columns = columns

    def __len__(self) -> int:
        return self.n

    def summary(self) -> dict[str, Any]:
        return {name: col.summary() for name, col in sorted(self.columns.items())}

    @classmethod
    def from_columns(cls, n: int, columns: dict[str, Any], limits: MetadataLimits = MetadataLimits()
                     ) -> "ItemMetadata":
        """Columns given whole (a Parquet file's, a bench's): per field a numeric array (NaN: missing), or
        ``(values, codes)`` for a categorical one (``codes`` int, ``-1``: missing). Refused like
        :meth:`from_objects` past the limits."""
        if len(columns) > limits.max_fields:
            raise _refused(f"{len(columns)} fields, over the limit max_fields={limits.max_fields}", "max_fields",
                           limits.max_fields)
        out: dict[str, Column] = {}
        for name, data in columns.items():
            _kind_of(name, "", -1, limits)  # the name's rules
            if isinstance(data, tuple):
                values, codes = data
                if len(values) > limits.max_values_per_field:
                    raise _refused(f"field {name!r} has over {limits.max_values_per_field} distinct values "
                                   "(max_values_per_field)", "max_values_per_field", limits.max_values_per_field)
                codes = np.asarray(codes, dtype=np.int32)
                if codes.shape != (n,) or (codes.size and (codes.min() < -1 or codes.max() >= len(values))):
                    raise _refused(f"field {name!r}: {n} codes into its {len(values)} values expected", name=name)
                ordered = sorted(range(len(values)), key=lambda i: _value_key(values[i]))
                remap = np.empty(len(values) + 1, dtype=np.int32)
                remap[np.asarray(ordered, dtype=np.int64)] = np.arange(len(values), dtype=np.int32)
                remap[-1] = -1
                sorted_values = tuple(values[i] for i in ordered)
                out[name] = Column(name, CATEGORICAL, sorted_values, codes=remap[codes],
                                   _index={_value_key(v): i for i, v in enumerate(sorted_values)})
            else:
                numbers = np.asarray(data, dtype=np.float64)
                if numbers.shape != (n,) or np.isinf(numbers).any():
                    raise _refused(f"field {name!r}: {n} finite numbers expected", name=name)
                out[name] = Column(name, NUMERIC, numbers=numbers)
        return cls(n, out)

    @classmethod
    def from_objects(cls, objects: Sequence[dict[str, Any] | None], limits: MetadataLimits = MetadataLimits()
                     ) -> "ItemMetadata":
        """Columns from one metadata object per item (``None`` or ``{}``: none). Refused (422 naming the item and
        the field or limit): a field of two kinds, a value that is not a string, boolean, number or list of strings,
        a non-finite number, an integer past 2^53, too many fields, values, list entries or bytes."""
        kinds: dict[str, str] = {}
        lists: dict[str, bool] = {}
        for i, obj in enumerate(objects):
            if obj is None:
                continue
            if not isinstance(obj, dict):
                raise _refused(f"item {i}: expected an object, got {type(obj).__name__}", item=i)
            size = len(json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode())
            if size > limits.max_item_bytes:
                raise _refused(f"item {i}: {size} bytes, over the limit max_item_bytes={limits.max_item_bytes}",
                               "max_item_bytes", limits.max_item_bytes, item=i)
            for name, value in obj.items():
                kind, is_list = _kind_of(name, value, i, limits)
                if name not in kinds:
                    if len(kinds) >= limits.max_fields:
                        raise _refused(f"item {i}: field {name!r} is one more than the limit max_fields="
                                       f"{limits.max_fields}", "max_fields", limits.max_fields, item=i)
                    kinds[name], lists[name] = kind, is_list
                elif kinds[name] != kind:
                    raise _refused(f"item {i}: field {name!r} is {kind} here and {kinds[name]} in an earlier item",
                                   item=i, name=name)
                else:
                    lists[name] = lists[name] or is_list
        columns = {name: _build(name, kinds[name], lists[name], objects, limits) for name in kinds}
        return cls(len(objects), columns)


    def check_splice(self, keep: np.ndarray, added: "ItemMetadata") -> None:
        """Refuse at once what :meth:`spliced` would refuse for a field of two kinds (a kept row has it as one, an
        added row as the other), without splicing: a PATCH checks it before its columns are spliced."""
        for name, new in added.columns.items():
            old = self.columns.get(name)
            if old is not None and old.kind != new.kind and _held(old, np.asarray(keep, dtype=bool)):
                raise _refused(f"field {name!r} is {new.kind} in an added item and {old.kind} in the catalog",
                               name=name)

    def spliced(self, keep: np.ndarray, added: "ItemMetadata", limits: MetadataLimits = MetadataLimits()
                ) -> "ItemMetadata":
        """The columns of this metadata's rows where ``keep`` (``bool`` per item) followed by ``added``'s rows: what
        :meth:`from_objects` gives for the same objects in that order (a PATCH's result: rows cut, rows appended),
        in passes over the arrays instead of a parse of every item. Values no row holds any more are dropped, and
        fields no row has. Refused like :meth:`from_objects` (a field of two kinds, the limits on fields and
        values)."""
        keep = np.asarray(keep, dtype=bool)
        n_keep = int(keep.sum())
        out: dict[str, Column] = {}
        for name in [*self.columns, *(k for k in added.columns if k not in self.columns)]:
            old, new = self.columns.get(name), added.columns.get(name)
            if old is not None and new is not None and old.kind != new.kind:
                if _held(old, keep):
                    raise _refused(f"field {name!r} is {new.kind} in an added item and {old.kind} in the catalog",
                                   name=name)
                old = None  # no row keeps the old kind: the field is the added items' now
            either = old if old is not None else new
            assert either is not None
            column = (_splice_numbers if either.kind == NUMERIC else _splice_categories)(
                name, old, keep, n_keep, new, added.n)
            if column is None:
                continue
            if len(column.values) > limits.max_values_per_field:
                raise _refused(f"field {name!r} has over {limits.max_values_per_field} distinct values "
                               f"(max_values_per_field)", "max_values_per_field", limits.max_values_per_field,
                               name=name)
            out[name] = column
        if len(out) > limits.max_fields:
            raise _refused(f"{len(out)} fields, over the limit max_fields={limits.max_fields}", "max_fields",
                           limits.max_fields)
        return ItemMetadata(n_keep + added.n, out)


def _held(column: Column, keep: np.ndarray) -> bool:
    """Whether a row where ``keep`` still has the field ``column``."""
    if column.numbers is not None:
        return bool((~np.isnan(column.numbers[keep])).any())
    if column.offsets is None:
        return bool((column.codes[keep] >= 0).any()) if column.codes is not None else False
    listed = column.listed[keep].any() if column.listed is not None else False
    return bool(listed or np.diff(column.offsets)[keep].any())


def _splice_numbers(name: str, old: Column | None, keep: np.ndarray, n_keep: int, new: Column | None,
                    n_new: int) -> Column | None:
    left = old.numbers[keep] if old is not None and old.numbers is not None else np.full(n_keep, np.nan)
    right = new.numbers if new is not None and new.numbers is not None else np.full(n_new, np.nan)
    numbers = np.concatenate((left, right))
    return Column(name, NUMERIC, numbers=numbers) if (~np.isnan(numbers)).any() else None


def _entries(column: Column | None, rows: np.ndarray | None, n: int) -> tuple[np.ndarray, np.ndarray, tuple]:
    """``(codes, lengths, values)`` of a categorical column over its rows where ``rows`` (all when None), as lists
    (a single value: a list of one; missing: none)."""
    if column is None or column.codes is None:
        return np.zeros(0, dtype=np.int32), np.zeros(n, dtype=np.int64), ()
    if column.offsets is None:
        codes = column.codes if rows is None else column.codes[rows]
        return codes[codes >= 0], (codes >= 0).astype(np.int64), column.values
    lengths = np.diff(column.offsets)
    codes = column.codes if rows is None else column.codes[np.repeat(rows, lengths)]
    return codes, lengths if rows is None else lengths[rows], column.values


def _splice_categories(name: str, old: Column | None, keep: np.ndarray, n_keep: int, new: Column | None,
                       n_new: int) -> Column | None:
    left_codes, left_lengths, left_values = _entries(old, keep, n_keep)
    right_codes, right_lengths, right_values = _entries(new, None, n_new)
    used_left = np.unique(left_codes)
    used_right = np.unique(right_codes)
    keys = sorted({_value_key(left_values[i]) for i in used_left.tolist()}
                  | {_value_key(right_values[i]) for i in used_right.tolist()})
    # rows that gave a list (maybe empty): the field is a list field while one does, and is there while one does
    listed = np.concatenate((old.listed[keep] if old is not None and old.listed is not None else np.zeros(n_keep, bool),
                             new.listed if new is not None and new.listed is not None else np.zeros(n_new, bool)))
    if not keys and not listed.any():
        return None
    index = {key: i for i, key in enumerate(keys)}
    values = tuple(v for _, v in keys)

    def remap(side_values: tuple, used: np.ndarray, codes: np.ndarray) -> np.ndarray:
        table = np.full(max(len(side_values), 1), -1, dtype=np.int32)
        for code in used.tolist():
            table[code] = index[_value_key(side_values[code])]
        return table[codes]

    codes = np.concatenate((remap(left_values, used_left, left_codes), remap(right_values, used_right, right_codes)))
    lengths = np.concatenate((left_lengths, right_lengths))
    if listed.any():
        offsets = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return Column(name, CATEGORICAL, values, codes=codes.astype(np.int32), offsets=offsets, listed=listed,
                      _index=index)
    single = np.full(lengths.size, -1, dtype=np.int32)
    single[lengths > 0] = codes
    return Column(name, CATEGORICAL, values, codes=single, _index=index)


def _kind_of(name: Any, value: Any, item: int, limits: MetadataLimits) -> tuple[str, bool]:
    if not isinstance(name, str) or not name or name.startswith("$") or len(name) > limits.max_name_length:
        raise _refused(f"item {item}: field name {shown_name(name)!r}: 1-{limits.max_name_length} characters, not "
                       "starting with '$'", item=item)
    if isinstance(value, (bool, str)):
        return CATEGORICAL, False
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise _refused(f"item {item}: field {name!r}: numbers must be finite", item=item, name=name)
        if isinstance(value, int) and abs(value) > EXACT_INT:
            raise _refused(f"item {item}: field {name!r}: integers up to 2^53 in magnitude", item=item, name=name)
        return NUMERIC, False
    if isinstance(value, list):
        if len(value) > limits.max_list_length:
            raise _refused(f"item {item}: field {name!r}: {len(value)} strings, over the limit max_list_length="
                           f"{limits.max_list_length}", "max_list_length", limits.max_list_length, item=item)
        if not all(isinstance(v, str) for v in value):
            raise _refused(f"item {item}: field {name!r}: a list holds strings only", item=item, name=name)
        return CATEGORICAL, True
    raise _refused(f"item {item}: field {name!r}: a string, a boolean, a number or a list of strings, got "
                   f"{type(value).__name__}", item=item, name=name)


def _build(name: str, kind: str, is_list: bool, objects: Sequence[dict[str, Any] | None],
           limits: MetadataLimits) -> Column:
    n = len(objects)
    if kind == NUMERIC:
        numbers = np.full(n, np.nan)
        for i, obj in enumerate(objects):
            if obj and name in obj:
                numbers[i] = obj[name]
        return Column(name, NUMERIC, numbers=numbers)
    distinct: set[tuple[int, Any]] = set()
    for obj in objects:
        if obj and name in obj:
            value = obj[name]
            distinct.update(_value_key(v) for v in (value if isinstance(value, list) else [value]))
            if len(distinct) > limits.max_values_per_field:
                raise _refused(f"field {name!r} has over {limits.max_values_per_field} distinct values "
                               f"(max_values_per_field)", "max_values_per_field", limits.max_values_per_field,
                               name=name)
    ordered = sorted(distinct)
    index = {key: i for i, key in enumerate(ordered)}
    values = tuple(v for _, v in ordered)
    if not is_list:
        codes = np.full(n, -1, dtype=np.int32)
        for i, obj in enumerate(objects):
            if obj and name in obj:
                codes[i] = index[_value_key(obj[name])]
        return Column(name, CATEGORICAL, values, codes=codes, _index=index)
    lengths = np.zeros(n, dtype=np.int64)
    listed = np.zeros(n, dtype=bool)
    flat: list[int] = []
    for i, obj in enumerate(objects):
        if obj and name in obj:
            value = obj[name]
            listed[i] = isinstance(value, list)
            entries = value if isinstance(value, list) else [value]
            lengths[i] = len(entries)
            flat.extend(index[_value_key(v)] for v in entries)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Column(name, CATEGORICAL, values, codes=np.asarray(flat, dtype=np.int32), offsets=offsets, listed=listed,
                  _index=index)
