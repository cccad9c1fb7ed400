"""Reading a catalog upload (the format: :mod:`processors.kinds.tree.catalog.catalog`) into a
:class:`~processors.kinds.tree.catalog.catalog.Catalog`, every rule checked: its text (:func:`parse_catalog`: array passes over
blocks of lines, ``json`` per line only to name a bad one), its items given as arrays (:func:`catalog_from_arrays`: a
Parquet ``ids`` column), and the items of a PATCH (:func:`check_items`, :func:`split_item`); a 422 names the line or
the field."""

from __future__ import annotations

import json
import re
from itertools import chain
from typing import Any

import numpy as np

from config import ConstraintError

from processors.kinds.tree.catalog.catalog import _RESERVED, Catalog
from processors.kinds.tree.catalog.lines import _ID_BLOCK, fast_items, row_keys

__all__ = ["canonical_meta", "catalog_from_arrays", "check_items", "parse_catalog", "split_item"]

_SHOWN = 20  # bad lines named in one error


def _bad(message: str, field_name: str, **detail: Any) -> ConstraintError:
    return ConstraintError(422, message, {"field": field_name, **detail})


def _check_id(value: Any, what: str, vocab_size: int) -> int:
    if type(value) is not int or not 0 <= value < vocab_size:
        raise _bad(f"items: header: {what} must be a token id in [0, {vocab_size}), got {value!r}", f"header.{what}")
    return value


def check_items(items: list[Any], *, end_token_id: int, vocab_size: int, where: str, numbers: list[int] | None = None,
                allow_empty: bool = False, max_item_tokens: int | None = None) -> list[tuple[int, ...]]:
    """``items`` (decoded JSON values) as tuples, or a 422 naming the first bad ones (``where[i]`` or line numbers
    from ``numbers``). The common case runs at C speed: one pass over the types, one numpy check of the ids.
    ``allow_empty``: the empty item ``[]`` is valid (a stored catalog made from a tree whose root allows the end
    token; a client's items are never empty). ``max_item_tokens``: an item longer than that is a 422 naming it and
    the limit (``Limits.max_item_tokens``), checked first."""
    def name(i: int) -> str:
        return f"line {numbers[i]}" if numbers is not None else f"{where}[{i}]"

    if max_item_tokens is not None:
        too_long = _first_too_long(np.fromiter((len(item) if isinstance(item, list) else 0 for item in items),
                                               dtype=np.int64, count=len(items)), max_item_tokens)
        if too_long is not None:
            raise _item_too_long(name(too_long), len(items[too_long]), max_item_tokens, where)
    problems: list[str] = []
    ok = set(map(type, items)) <= {list} and set(map(type, chain.from_iterable(items))) <= {int}
    if ok:
        lengths = np.fromiter(map(len, items), dtype=np.int64, count=len(items))
        flat = np.fromiter(chain.from_iterable(items), dtype=np.int64, count=int(lengths.sum()))
        ok = bool(lengths.size == 0 or allow_empty or lengths.min() > 0) and bool(
            flat.size == 0 or (flat.min() >= 0 and flat.max() < vocab_size and not (flat == end_token_id).any()))
    if not ok:  # find and name them (the slow path runs only for a refusal)
        for i, item in enumerate(items):
            if not isinstance(item, list) or not (item or allow_empty):
                problems.append(f"{name(i)}: an item is a non-empty JSON array of token ids, got {json.dumps(item)[:60]}")
            elif any(type(t) is not int or not 0 <= t < vocab_size for t in item):
                problems.append(f"{name(i)}: token ids must be integers in [0, {vocab_size}), got {json.dumps(item)[:60]}")
            elif end_token_id in item:
                problems.append(f"{name(i)}: an item holds the tokens after the root without the end token "
                                f"{end_token_id}, got {json.dumps(item)[:60]}")
            if len(problems) >= _SHOWN:
                break
        raise _bad(f"{where}: {len(problems)}{'+' if len(problems) >= _SHOWN else ''} invalid items: "
                   + "; ".join(problems), where, problems=problems)
    return [tuple(item) for item in items]


def _first_too_long(lengths: np.ndarray, limit: int) -> int | None:
    """The index of the first length over ``limit``, or None."""
    over = np.flatnonzero(lengths > limit)
    return int(over[0]) if over.size else None


def _item_too_long(what: str, length: int, limit: int, field_name: str) -> ConstraintError:
    return ConstraintError(422, f"{field_name}: {what}: an item of {length} tokens exceeds the limit "
                             f"max_item_tokens={limit}",
                        {"field": field_name, "limit_name": "max_item_tokens", "limit": limit})


def parse_catalog(data: bytes, *, vocab_size: int, max_items: int | None = None, allow_empty: bool = False,
                  max_item_tokens: int | None = None) -> Catalog:
    """Parse and validate a catalog upload (see the module docstring); a 422 names the line. ``allow_empty``: the
    line ``[]`` (the empty item) is valid, as in a catalog the manager stored for a patched tree whose root allows the
    end token (:func:`items_from_tree`); an upload never has it. ``max_item_tokens``: an item line with more ids is
    a 422 naming its line and ``max_item_tokens`` (an upload; a stored catalog is read without it)."""
    if not isinstance(data, (bytes, bytearray)):
        raise _bad("items: the body must be catalog text (one JSON value per line)", "body")
    data = bytes(data)
    pos, line_no = 0, 1
    while True:  # the header: the first non-blank line
        end = data.find(b"\n", pos)
        first = data[pos:] if end < 0 else data[pos:end]
        if first.strip() or end < 0:
            break
        pos, line_no = end + 1, line_no + 1
    if not first.strip():
        raise _bad("items: the body is empty; the first line is the header "
                   '{"start_token_id": ..., "end_token_id": ...}', "body")
    start, end_id, options = _header(first, line_no, vocab_size)
    body = b"" if end < 0 else data[end + 1:]
    fast = fast_items(body)
    if fast is None:
        with_meta = _meta_catalog(body, start, end_id, options, vocab_size, max_items, allow_empty, max_item_tokens)
        if with_meta is not None:
            return with_meta
        return _slow_catalog(body, line_no + 1, start, end_id, options, vocab_size, max_items, allow_empty,
                             max_item_tokens)
    texts, flat, lengths, keys, ends = fast
    if max_items is not None and lengths.size > max_items:
        raise _too_many(int(lengths.size), max_items)
    if max_item_tokens is not None:
        too_long = _first_too_long(lengths, max_item_tokens)
        if too_long is not None:  # its line number: the too_long-th non-blank line after the header
            numbers = [line_no + 1 + i for i, line in enumerate(body.split(b"\n")) if line.strip()]
            raise _item_too_long(f"line {numbers[too_long]}", int(lengths[too_long]), max_item_tokens, "items")
    if not lengths.size:
        raise _bad("items: the catalog has no items (one JSON array of token ids per line after the header)", "items")
    if flat.max() >= vocab_size or (flat == end_id).any() or _repeats(flat, lengths, keys):
        return _slow_catalog(body, line_no + 1, start, end_id, options, vocab_size, max_items,
                             allow_empty, max_item_tokens)  # to name the lines
    catalog = Catalog(start, end_id, flat, lengths, options)
    head = catalog.header() + b"\n"
    catalog._content = b"".join([head, *texts])  # canonical: the lines as read, spaces dropped
    catalog._ends, catalog._row_keys = ends + len(head), keys
    return catalog


_NULL = re.compile(rb"[:,\[]\s*null")  # a null value (Arrow's reader reads it as a missing field; json does not)
_FLOATISH = re.compile(rb"[0-9][.eE]")  # a line that may write a number as a float


def _meta_catalog(body: bytes, start: int, end_id: int, options: dict[str, Any], vocab_size: int,
                  max_items: int | None, allow_empty: bool, max_item_tokens: int | None) -> Catalog | None:
    """:func:`parse_catalog` of item lines some of which are ``{"ids": [...], "metadata": {...}}`` objects, by
    columns: the object lines read by Arrow's JSON reader (C++, on threads), the bare arrays by :func:`fast_items`,
    the metadata's columns and each item's canonical text made from Arrow's columns
    (:func:`~processors.kinds.tree.catalog.columns.arrow_metadata`): no Python object per item. None when anything
    is not as every rule wants it (a bad line, an item twice, a limit passed, a null, a field of two kinds, a line
    that is not an object or an array from its first byte, ...): the lines are then parsed one at a time, which
    names the problem (422)."""
    import pyarrow as pa
    import pyarrow.json as pj

    from processors.kinds.tree.catalog.columns import with_arrow_metadata

    if b"null" in body and _NULL.search(body):
        return None
    if body and not body.endswith(b"\n"):
        body = body + b"\n"
    a = np.frombuffer(body, dtype=np.uint8)
    raw_ends = np.flatnonzero(a == 10) + 1  # each line's end, after its newline
    raw_starts = np.concatenate(([0], raw_ends[:-1]))
    blank = raw_ends - raw_starts == 1
    first = a[raw_starts]
    is_obj, is_arr = first == 123, first == 91  # '{', '['
    if not (is_obj | is_arr | blank).all() or not is_obj.any():
        return None
    n = int(raw_starts.size - np.count_nonzero(blank))
    if max_items is not None and n > max_items:
        raise _too_many(n, max_items)
    line_start, line_end = raw_starts[~blank], raw_ends[~blank] - 1  # (without the newline)
    obj_rows, arr_rows = np.flatnonzero(is_obj[~blank]), np.flatnonzero(is_arr[~blank])
    if arr_rows.size:
        take = np.repeat(is_obj, raw_ends - raw_starts)
        objects, arrays = a[take].tobytes(), a[~take].tobytes()
    else:
        objects, arrays = body, b""
    try:
        table = pj.read_json(pa.BufferReader(objects), parse_options=pj.ParseOptions(newlines_in_values=False))
    except Exception:  # noqa: BLE001 - pyarrow refuses in several kinds; the json parse names the line
        return None
    if not set(table.column_names) <= {"ids", "metadata"} or "ids" not in table.column_names:
        return None
    ids = table.column("ids").combine_chunks()
    if table.num_rows != obj_rows.size or not (pa.types.is_list(ids.type) and (
            pa.types.is_integer(ids.type.value_type) or pa.types.is_null(ids.type.value_type))) or ids.null_count:
        return None
    values = ids.flatten()
    if values.null_count:
        return None
    obj_flat = values.to_numpy(zero_copy_only=False).astype(np.int64)
    obj_lengths = np.diff(ids.offsets.to_numpy()).astype(np.int64)
    if obj_flat.size and (obj_flat.min() < 0 or obj_flat.max() >= vocab_size):
        return None
    lengths = np.empty(n, dtype=np.int64)
    lengths[obj_rows] = obj_lengths
    arr_flat = arr_lengths = np.zeros(0, dtype=np.int64)
    if arr_rows.size:
        fast = fast_items(arrays)
        if fast is None or fast[2].size != arr_rows.size:
            return None
        arr_flat, arr_lengths = fast[1], fast[2].astype(np.int64)
        lengths[arr_rows] = arr_lengths
    if (not allow_empty and int(lengths.min()) == 0) or (max_item_tokens is not None
                                                        and int(lengths.max()) > max_item_tokens):
        return None
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    if arr_rows.size:  # the two kinds of lines' ids, each row's where it goes
        flat = np.empty(int(lengths.sum()), dtype=np.int32)
        flat[_positions(starts[obj_rows], obj_lengths)] = obj_flat
        flat[_positions(starts[arr_rows], arr_lengths)] = arr_flat
    else:
        flat = obj_flat.astype(np.int32)
    lengths = lengths.astype(np.int32)
    keys = row_keys(flat, lengths)
    if (flat.size and bool((flat == end_id).any())) or _repeats(flat, lengths, keys):
        return None
    catalog = Catalog(start, end_id, flat, lengths, options)
    catalog._row_keys = keys
    if "metadata" not in table.column_names:
        return catalog
    meta = table.column("metadata").combine_chunks()
    if not pa.types.is_struct(meta.type):
        return None
    fields = dict(zip([f.name for f in meta.type], meta.flatten()))  # (flatten: a null object's fields null)
    if arr_rows.size:  # the fields over every item (a bare array's missing)
        at = np.full(n, -1, dtype=np.int64)
        at[obj_rows] = np.arange(obj_rows.size)
        where = pa.array(at, mask=at < 0)
        fields = {name: column.take(where) for name, column in fields.items()}

    def float_rows(name: str, rows: np.ndarray) -> np.ndarray | None:
        """Which of the items ``rows`` wrote field ``name`` as a float (a line with no float text: none)."""
        out = np.zeros(rows.size, dtype=bool)
        for k, row in enumerate(rows.tolist()):
            lo, hi = int(line_start[row]), int(line_end[row])
            if _FLOATISH.search(body, lo, hi) is None:
                continue
            try:
                out[k] = isinstance(json.loads(body[lo:hi])["metadata"][name], float)
            except Exception:  # noqa: BLE001
                return None
        return out

    return with_arrow_metadata(catalog, fields, float_rows)


def _positions(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Where the ids of rows starting at ``starts`` with ``lengths`` ids go, one after the other (int64)."""
    offsets = np.zeros(lengths.size, dtype=np.int64)
    np.cumsum(lengths[:-1], out=offsets[1:])
    return np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def catalog_from_arrays(header_line: bytes, flat: np.ndarray, lengths: np.ndarray, *, vocab_size: int,
                        max_items: int | None = None, max_item_tokens: int | None = None) -> Catalog | None:
    """The catalog of a header line and items given as arrays (a Parquet upload's ``ids`` column: no item text made
    or parsed), checked as :func:`parse_catalog` checks an upload's text; ``None`` when an item breaks a rule that a
    422 names by its line (an empty item, one too long, an id outside the vocabulary or the end token, an item
    twice): the caller then parses the text form, which names it. Its canonical bytes are made when asked."""
    start, end_id, options = _header(header_line, 1, vocab_size)
    lengths = np.asarray(lengths, dtype=np.int32)
    if max_items is not None and lengths.size > max_items:
        raise _too_many(int(lengths.size), max_items)
    if not lengths.size:
        raise _bad("items: the catalog has no items (one JSON array of token ids per line after the header)", "items")
    if int(lengths.min()) == 0 or (max_item_tokens is not None and int(lengths.max()) > max_item_tokens):
        return None
    flat = np.asarray(flat, dtype=np.int32)
    if int(flat.max()) >= vocab_size or _holds(flat, end_id):
        return None
    keys = row_keys(flat, lengths)
    if _repeats(flat, lengths, keys):
        return None
    catalog = Catalog(start, end_id, flat, lengths, options)
    catalog._row_keys = keys
    return catalog


def _holds(flat: np.ndarray, value: int) -> bool:
    """Whether ``value`` is among ``flat``, a block at a time (no boolean array the size of ``flat``)."""
    return any(bool((flat[lo:lo + _ID_BLOCK] == value).any()) for lo in range(0, flat.size, _ID_BLOCK))


def _header(first: bytes, line_no: int, vocab_size: int) -> tuple[int, int, dict[str, Any]]:
    """The header line's root and end ids and its scenario fields; a 422 naming line ``line_no``."""
    from config.strict_json import BodyRejected, parse_json

    try:  # strict, as every admin body: no lone surrogates, no repeated keys, no NaN (a 422, never a 500 later)
        header = parse_json(first, field="header")
    except BodyRejected as error:
        raise _bad(f"items: line {line_no}: {error}", error.field) from None
    except (ValueError, RecursionError) as exc:
        raise _bad(f"items: line {line_no}: the header is not JSON: {exc}", "header") from None
    if not isinstance(header, dict):
        raise _bad(f"items: line {line_no}: the first line is the header, a JSON object with start_token_id and "
                   f"end_token_id; got {json.dumps(header)[:60]}", "header")
    if header.get("format", "cs-items") != "cs-items":
        raise _bad(f"items: header: format must be 'cs-items', got {header.get('format')!r}", "header.format")
    for required in ("start_token_id", "end_token_id"):
        if required not in header:
            raise _bad(f"items: header: {required} is required", f"header.{required}")
    start = _check_id(header["start_token_id"], "start_token_id", vocab_size)
    end_id = _check_id(header["end_token_id"], "end_token_id", vocab_size)
    reserved = sorted(_RESERVED & set(header))
    if reserved:
        raise _bad(f"items: header: {', '.join(reserved)} cannot be set in a catalog header", f"header.{reserved[0]}")
    options = {k: v for k, v in header.items() if k not in ("format", "start_token_id", "end_token_id")}
    return start, end_id, options


def _repeats(flat: np.ndarray, lengths: np.ndarray, keys: np.ndarray) -> bool:
    """Whether an item occurs twice: the rows whose key (:func:`row_keys`) another row shares, compared by their
    ids (one sort of the keys, no set of every line)."""
    ordered = np.sort(keys)
    same = ordered[1:] == ordered[:-1]
    if not same.any():
        return False
    rows = np.flatnonzero(np.isin(keys, ordered[1:][same])).tolist()
    seen = Catalog(0, 0, flat, lengths).rows(rows)
    return len(set(seen)) != len(seen)


def _too_many(count: int, limit: int) -> ConstraintError:
    return ConstraintError(422, f"items: {count} items exceeds the limit max_tree_keys={limit}",
                        {"field": "items", "limit_name": "max_tree_keys", "limit": limit})


def _slow_catalog(body: bytes, first_line: int, start: int, end: int, options: dict[str, Any], vocab_size: int,
                  max_items: int | None, allow_empty: bool = False, max_item_tokens: int | None = None) -> Catalog:
    """The item lines parsed one JSON value at a time: names the first bad lines (422)."""
    raw_lines = body.split(b"\n")
    numbers = [first_line + i for i, line in enumerate(raw_lines) if line.strip()]
    texts = [line for line in raw_lines if line.strip()]
    if max_items is not None and len(texts) > max_items:
        raise _too_many(len(texts), max_items)
    items = []
    metas: list[Any] = []
    for n, line in zip(numbers, texts):
        try:
            value = json.loads(line)
        except (ValueError, RecursionError) as exc:
            raise _bad(f"items: line {n}: not a JSON value: {exc}", "items", line=n) from None
        ids, meta = split_item(value, f"line {n}", "items")
        items.append(ids)
        metas.append(meta)
    if not items:
        raise _bad("items: the catalog has no items (one JSON array of token ids per line after the header)", "items")
    tuples = check_items(items, end_token_id=end, vocab_size=vocab_size, where="items", numbers=numbers,
                         allow_empty=allow_empty, max_item_tokens=max_item_tokens)
    seen: dict[tuple[int, ...], int] = {}
    for n, item in zip(numbers, tuples):
        if item in seen:
            raise _bad(f"items: line {n}: item {list(item)} repeats line {seen[item]}", "items", line=n)
        seen[item] = n
    catalog = Catalog.from_items(start, end, tuples, options)
    if any(m is not None for m in metas):
        from processors.kinds.tree.filters.metadata import ItemMetadata, MetadataLimits

        # checked first (a 422 naming the item and the limit: kinds, non-finite numbers, sizes), kept for the compile
        metadata = ItemMetadata.from_objects(metas, MetadataLimits())
        catalog.meta = [None if m is None else canonical_meta(m) for m in metas]
        catalog._metadata = metadata
    return catalog


def split_item(value: Any, where: str, field_name: str) -> tuple[Any, dict[str, Any] | None]:
    """``(ids, metadata)`` of one catalog item: a bare array of ids, or ``{"ids": [...], "metadata": {...}}``
    (a 422 naming ``where`` for another object)."""
    if not isinstance(value, dict):
        return value, None
    extra = sorted(set(value) - {"ids", "metadata"})
    if "ids" not in value or extra:
        raise _bad(f"{field_name}: {where}: an item with metadata is {{\"ids\": [...], \"metadata\": {{...}}}}"
                   + (f"; unknown keys {extra}" if extra else "; ids is missing"), field_name)
    meta = value.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        raise _bad(f"{field_name}: {where}: metadata must be an object, got {type(meta).__name__}", field_name)
    return value["ids"], meta or None


def canonical_meta(meta: dict[str, Any]) -> bytes:
    """The stored form of one item's metadata (keys sorted, compact, UTF-8)."""
    return json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")
