"""A catalog's item metadata without a Python object per item: each item's canonical metadata text in one buffer
(:class:`MetaRows`), and both it and the metadata columns (:class:`~processors.kinds.tree.filters.metadata.ItemMetadata`)
made from Arrow columns, one per field (:func:`arrow_metadata`: a Parquet file's columns, or the fields of an NDJSON
upload read by Arrow's JSON reader), by Arrow's kernels and numpy passes.

:func:`arrow_metadata` gives exactly what ``ItemMetadata.from_objects`` and ``parse.canonical_meta`` give for the
same items, or None where it cannot tell it does (a null inside a list, a list longer than
``MetadataLimits.max_list_length``, a limit passed, a non-finite number, an integer past 2^53, a field name the rules
refuse): the caller then reads the items one object at a time, which names the problem."""

from __future__ import annotations

import json
from typing import Any, Callable, Iterator, Sequence

import numpy as np

__all__ = ["MetaRows", "arrow_metadata"]

_NONE = b"-"  # a row without metadata, in MetaRows.text (a metadata text is a JSON object: never this)


class MetaRows(Sequence):
    """Per item, its metadata object's canonical JSON (``bytes``) or None (none), held as one buffer: ``text`` is
    each item's text (``b"-"`` for None) followed by a newline, ``ends`` where each one's newline ends (int64). What
    ``Catalog.metadata_digest`` hashes is ``text`` itself. Reads like a list (``meta[i]``, ``len``, iteration,
    ``==`` a list)."""

    def __init__(self, text: bytes, ends: np.ndarray):
        self.text, self.ends = text, np.asarray(ends, dtype=np.int64)

    @classmethod
    def from_list(cls, metas: Sequence[bytes | None]) -> "MetaRows":
        pieces = [_NONE if m is None else m for m in metas]
        ends = np.cumsum(np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces)) + 1)
        return cls(b"".join(p + b"\n" for p in pieces), ends)

    @classmethod
    def none(cls, n: int) -> "MetaRows":
        """``n`` rows without metadata."""
        return cls((_NONE + b"\n") * n, np.arange(1, n + 1, dtype=np.int64) * 2)

    def __len__(self) -> int:
        return int(self.ends.size)

    def _at(self, i: int) -> bytes | None:
        end = int(self.ends[i])
        start = int(self.ends[i - 1]) if i else 0
        piece = self.text[start:end - 1]
        return None if piece == _NONE else piece

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self._at(j) for j in range(*i.indices(len(self)))]
        i = int(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._at(i)

    def __iter__(self) -> Iterator[bytes | None]:
        for piece in self.text.split(b"\n")[:len(self)]:
            yield None if piece == _NONE else piece

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MetaRows):
            return self.text == other.text
        if isinstance(other, (list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    @property
    def nbytes(self) -> int:
        return len(self.text) + int(self.ends.nbytes)

    def present(self) -> np.ndarray:
        """Whether each item has metadata (bool)."""
        starts = np.concatenate(([0], self.ends[:-1]))
        a = np.frombuffer(self.text, dtype=np.uint8)
        return (self.ends - starts != 2) | (a[starts] != _NONE[0]) if self.ends.size else np.zeros(0, bool)

    def spliced(self, cut: Sequence[int], added: Sequence[bytes | None]) -> "MetaRows":
        """These rows less the rows ``cut`` (ascending) with ``added`` after them (a PATCH's result): the text between
        the cut rows copied as it is."""
        rows = np.asarray(cut, dtype=np.int64)
        starts = np.concatenate(([0], self.ends[:-1]))
        view = memoryview(self.text)
        bounds_from = [0, *self.ends[rows].tolist()]
        bounds_to = [*starts[rows].tolist(), len(self.text)]
        tail = MetaRows.from_list(added)
        text = b"".join([*(view[a:b] for a, b in zip(bounds_from, bounds_to) if b > a), tail.text])
        sizes = self.ends - starts
        kept = np.delete(sizes, rows)
        ends = np.cumsum(np.concatenate((kept, np.diff(tail.ends, prepend=0))))
        return MetaRows(text, ends)

    def arrow(self) -> Any:
        """Each row's text as an Arrow ``large_binary`` array, null where the row has no metadata (no copy of the
        text beyond one slice per row's kernel)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        offsets = np.zeros(len(self) + 1, dtype=np.int64)
        offsets[1:] = self.ends
        rows = pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(self), [None, pa.py_buffer(offsets),
                                                                              pa.py_buffer(self.text)])
        rows = pc.binary_slice(rows, 0, -1)  # (each row's newline dropped)
        return pc.if_else(pa.array(self.present()), rows, pa.scalar(None, pa.large_binary()))


# -- the columns ------------------------------------------------------------------------------------------------

#: doubles whose shortest text Arrow writes as Python's ``repr`` does (past ``.0`` on integral values); others are
#: written by ``repr`` (Arrow switches to an exponent at other magnitudes)
_SAFE_LOW, _SAFE_HIGH = 1e-4, 1e10


def arrow_kind(pa: Any, typ: Any) -> str | None:
    """The metadata kind of an Arrow type: ``null`` (every row null), ``str``, ``bool``, ``int``, ``float`` or
    ``list`` (of strings, or of nulls only); None for any other type."""
    if pa.types.is_null(typ):
        return "null"
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        return "str"
    if pa.types.is_boolean(typ):
        return "bool"
    if pa.types.is_integer(typ):
        return "int"
    if pa.types.is_floating(typ):
        return "float"
    if pa.types.is_list(typ) or pa.types.is_large_list(typ):
        value = typ.value_type
        if pa.types.is_string(value) or pa.types.is_large_string(value) or pa.types.is_null(value):
            return "list"
    return None


def arrow_metadata(columns: dict[str, Any], n: int, limits: Any = None,
                   float_rows: Callable[[str, np.ndarray], np.ndarray | None] | None = None):
    """``(MetaRows, ItemMetadata)`` of ``n`` items whose fields are the Arrow arrays ``columns`` (name -> array of
    ``n``, null: the item lacks the field; a string, boolean, integer or float array, or a list of strings), in
    the order the fields first occur, or None (see the module docstring). A float array holds the items' numbers as
    floats: ``float_rows(name, rows)``, when given, says which of the rows ``rows`` (those whose value is integral)
    wrote theirs as a float (``3.0``, not ``3``: an NDJSON reader's column of both), or None when it cannot."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from processors.kinds.tree.filters.metadata import (CATEGORICAL, EXACT_INT, NUMERIC, Column, ItemMetadata,
                                                        MetadataLimits, _kind_of, _value_key)

    limits = limits or MetadataLimits()
    fields: list[tuple[int, int, str, Any, str]] = []
    for position, (name, array) in enumerate(columns.items()):
        array = array.combine_chunks() if isinstance(array, pa.ChunkedArray) else array
        kind = arrow_kind(pa, array.type)
        if kind is None or len(array) != n:
            return None
        if kind == "null" or array.null_count == n:
            continue
        valid = array.is_valid().to_numpy(zero_copy_only=False)
        fields.append((int(np.argmax(valid)), position, name, array, kind))
    fields.sort(key=lambda f: (f[0], f[1]))  # the order from_objects meets them in
    if len(fields) > limits.max_fields:
        return None
    out: dict[str, Column] = {}
    texts: list[Any] = []
    text = pa.large_string()
    for _, _, name, array, kind in fields:
        try:
            _kind_of(name, "", -1, limits)
        except Exception:  # noqa: BLE001 - the name's rules: the object read names it
            return None
        key = pa.scalar(json.dumps(name, ensure_ascii=False) + ":", text)
        if kind in ("str", "bool", "list"):
            made = _categorical(pa, pc, name, array, kind, n, limits, CATEGORICAL, Column, _value_key)
            if made is None:
                return None
            column, values = made
        else:
            numbers = pc.cast(array, pa.float64()).to_numpy(zero_copy_only=False)
            valid = array.is_valid().to_numpy(zero_copy_only=False)
            numbers = np.where(valid, numbers, np.nan)
            if not np.isfinite(numbers[valid]).all() or (np.abs(numbers[valid]) > EXACT_INT).any() and kind == "int":
                return None
            column = Column(name, NUMERIC, numbers=numbers)
            values = _number_text(pa, pc, array, kind, numbers, valid, name, float_rows)
            if values is None:
                return None
        out[name] = column
        texts.append((name, pc.binary_join_element_wise(key, values, pa.scalar(",", text), pa.scalar("", text))))
    texts = [values for _, values in sorted(texts, key=lambda t: t[0])]  # (canonical: the keys sorted)
    if not texts:
        return MetaRows.none(n), ItemMetadata(n, {})
    present = np.zeros(n, dtype=bool)
    for values in texts:
        present |= values.is_valid().to_numpy(zero_copy_only=False)
    # each field's '"name":value,' (null: missing) joined, the last comma dropped ("skip" of nulls loses rows)
    joined = pc.binary_join_element_wise(*texts, pa.scalar("", text), null_handling="replace", null_replacement="")
    joined = pc.utf8_slice_codeunits(joined, 0, -1)
    rows = pc.binary_join_element_wise(pa.scalar("{", text), joined, pa.scalar("}\n", text), pa.scalar("", text))
    rows = pc.if_else(pa.array(present), rows, pa.scalar("-\n", text))
    sizes = pc.binary_length(rows).to_numpy(zero_copy_only=False).astype(np.int64)
    if n and int(sizes[present].max(initial=0)) - 1 > limits.max_item_bytes:
        return None  # (the object read names the item and the limit)
    offsets = np.frombuffer(rows.buffers()[1], dtype=np.int64, count=n + 1, offset=8 * rows.offset)
    data = rows.buffers()[2][int(offsets[0]):int(offsets[-1])].to_pybytes()
    return MetaRows(data, offsets[1:] - offsets[0]), ItemMetadata(n, out)


def _categorical(pa, pc, name, array, kind, n, limits, CATEGORICAL, Column, value_key):
    """``(Column, each row's value text)`` of a string, boolean or list-of-strings array, or None."""
    text = pa.large_string()
    if kind == "list":
        if pa.types.is_list(array.type):
            array = array.cast(pa.large_list(pa.large_string()))
        else:
            array = array.cast(pa.large_list(pa.large_string()))
        lengths = pc.list_value_length(array).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        if lengths.size and int(lengths.max()) > limits.max_list_length:
            return None
        entries = array.flatten()
        if entries.null_count:
            return None
        encoded = pc.dictionary_encode(entries)
    else:
        encoded = pc.dictionary_encode(array)
    dictionary = encoded.dictionary.to_pylist()
    if len(dictionary) > limits.max_values_per_field:
        return None
    ordered = sorted(range(len(dictionary)), key=lambda i: value_key(dictionary[i]))
    remap = np.empty(len(dictionary) + 1, dtype=np.int32)
    remap[np.asarray(ordered, dtype=np.int64)] = np.arange(len(dictionary), dtype=np.int32)
    remap[-1] = -1
    values = tuple(dictionary[i] for i in ordered)
    index = {value_key(v): i for i, v in enumerate(values)}
    codes = remap[encoded.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)]
    shown = pa.array([json.dumps(v, ensure_ascii=False) for v in dictionary], text)
    per_entry = pc.take(shown, encoded.indices)
    if kind != "list":
        return Column(name, CATEGORICAL, values, codes=codes, _index=index), per_entry
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    listed = array.is_valid().to_numpy(zero_copy_only=False)
    lists = pa.LargeListArray.from_arrays(pa.array(offsets), per_entry, mask=pa.array(~listed))
    joined = pc.binary_join(lists, pa.scalar(",", text))
    shown_rows = pc.binary_join_element_wise(pa.scalar("[", text), joined, pa.scalar("]", text), pa.scalar("", text))
    return Column(name, CATEGORICAL, values, codes=codes.astype(np.int32), offsets=offsets, listed=listed,
                  _index=index), shown_rows


def _number_text(pa, pc, array, kind, numbers, valid, name, float_rows):
    """Each row's number as ``json.dumps`` writes the value the item gave (an int as an int, a float by its
    ``repr``), null where missing; None when it cannot tell."""
    text = pa.large_string()
    if kind == "int":
        return pc.cast(pc.cast(array, pa.int64()), text)
    floats = pc.cast(array, pa.float64())
    shown = pc.cast(floats, text)
    magnitude = np.abs(numbers)
    odd = valid & (magnitude != 0) & ((magnitude < _SAFE_LOW) | (magnitude >= _SAFE_HIGH))
    integral = valid & (numbers == np.floor(numbers)) & ~odd
    as_int = np.zeros(numbers.size, dtype=bool)
    if float_rows is not None and integral.any():  # which of the integral values were written as integers
        rows = np.flatnonzero(integral)
        wrote_float = float_rows(name, rows)
        if wrote_float is None:
            return None
        as_int[rows[~wrote_float]] = True
        if (magnitude[rows[~wrote_float]] > 2 ** 53).any():
            return None
    if float_rows is not None and odd.any():  # (an integer past 1e10 read as a float)
        rows = np.flatnonzero(odd & (numbers == np.floor(numbers)))
        if rows.size:
            wrote_float = float_rows(name, rows)
            if wrote_float is None:
                return None
            as_int[rows[~wrote_float]] = True
            odd[rows[~wrote_float]] = False
            if (magnitude[rows[~wrote_float]] > 2 ** 53).any():
                return None
    dotted = integral & ~as_int  # Arrow writes 3.0 as "3": Python as "3.0"
    if dotted.any():
        shown = pc.if_else(pa.array(dotted), pc.binary_join_element_wise(shown, pa.scalar(".0", text),
                                                                         pa.scalar("", text)), shown)
    if as_int.any():
        ints = pa.array(np.where(as_int, numbers, 0).astype(np.int64)).cast(text)
        shown = pc.if_else(pa.array(as_int), ints, shown)
    if odd.any():
        rows = np.flatnonzero(odd)
        shown = pc.replace_with_mask(shown, pa.array(odd), pa.array([repr(float(x)) for x in numbers[rows]], text))
    return shown


def with_arrow_metadata(catalog: Any, columns: dict[str, Any], float_rows: Any = None) -> Any:
    """``catalog`` with the metadata of the Arrow arrays ``columns`` (:func:`arrow_metadata`, one array per field
    over its items), or None when a value breaks a rule or a kernel refuses it (the per-line read then names it)."""
    import pyarrow as pa

    try:
        made = arrow_metadata(columns, len(catalog), float_rows=float_rows)
    except (pa.ArrowException, ValueError, OverflowError):
        return None
    if made is None:
        return None
    meta, metadata = made
    if metadata.columns:
        catalog.meta, catalog._metadata = meta, metadata
    return catalog
