"""Catalogs uploaded as Parquet, the file a data pipeline already writes: a column ``ids`` (a list of integers per
row: an item's token ids after the root, without the end token) and any other columns as the items' metadata (a
string, boolean, integer or float column, or a list of strings; a null leaves the field out for that item). The
catalog's header (the scenario fields of the NDJSON format's first line: ``start_token_id``, ``end_token_id``, a
default ``filter``, ...) is a JSON object in the file's key-value metadata under ``catalog``::

    table = pa.table({"ids": ids, "region": regions, "stock": stock})
    table = table.replace_schema_metadata({"catalog": json.dumps({"start_token_id": 2000, "end_token_id": 2})})
    pq.write_table(table, "catalog.parquet")

:func:`parquet_items` reads such a file into the parsed catalog: a file without metadata columns straight from its
``ids`` column's arrays (checked by the rules of the NDJSON form, no item text made: what a 10^7-10^8-item upload
needs), any other through the catalog's NDJSON form (:func:`parquet_catalog`, :mod:`processors.kinds.tree.catalog.catalog`), parsed like any
upload: one set of rules and limits. The row count and the
columns' types are checked from the file's footer before any column is read.

What the manager's memory estimate reads (:class:`ParquetShape`): the footer's counts (:func:`parquet_shape`: rows,
ids, metadata values, the strings' uncompressed bytes), then the string columns' bytes as they decode
(:func:`parquet_strings`: a dictionary page's value counted once per row that holds it, the columns read as
dictionaries, not expanded), where a row whose metadata is over the per-item bound is refused.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import numpy as np

from config import ConstraintError
from config.echo import shown_name

__all__ = ["HEADER_KEY", "PARQUET_CONTENT_TYPES", "ParquetShape", "parquet_catalog", "parquet_items", "parquet_shape",
           "parquet_strings"]

#: request content types read as a Parquet catalog (the first is the registered one)
PARQUET_CONTENT_TYPES = ("application/vnd.apache.parquet", "application/x-parquet")
#: the key of the file's key-value metadata that holds the catalog's header (a JSON object)
HEADER_KEY = "catalog"
IDS = "ids"
#: the longest JSON text of a number (``-2.2250738585072014e-308``; an int64 has at most 20 characters)
NUMBER_TEXT = 24


def _refused(message: str, field: str = "body", **detail: Any) -> ConstraintError:
    return ConstraintError(422, f"{field}: {message}", {"field": field, **detail})


def _kind(pa: Any, column: str, typ: Any) -> str:
    """The metadata kind of a column's Arrow type: ``str``, ``bool``, ``int``, ``float`` or ``list`` (of strings)."""
    from processors.kinds.tree.catalog.columns import arrow_kind

    kind = arrow_kind(pa, typ)
    if kind is not None and not (kind == "list" and pa.types.is_null(typ.value_type)):
        return kind
    raise _refused(f"column {shown_name(column)!r} has type {typ}; metadata columns are strings, booleans, integers, "
                   "floats or lists of strings", field=f"parquet.{shown_name(column)}")


def parquet_items(data: bytes, *, vocab_size: int, max_items: int, max_item_tokens: int | None = None):
    """The parsed catalog (:class:`~processors.kinds.tree.catalog.catalog.Catalog`) of a Parquet upload. A file without metadata columns goes
    straight from its ``ids`` column to the catalog's arrays (:func:`~processors.kinds.tree.catalog.parse.catalog_from_arrays`: no item text made
    or parsed, no Python object per row); a file with metadata, or one with an item that breaks a rule (named by its
    line), is read as the NDJSON it spells (:func:`parquet_catalog`) and parsed. Refusals as there."""
    from processors.kinds.tree.catalog.parse import catalog_from_arrays, parse_catalog

    import pyarrow.compute as pc

    pa, header, table, kinds, ids, values = _read(data, max_items)
    lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False)
    catalog = catalog_from_arrays(_header_line(header), values, lengths, vocab_size=vocab_size,
                                  max_items=max_items, max_item_tokens=max_item_tokens)
    if catalog is not None and any(kind != "null" for kind in kinds.values()):
        catalog = _with_metadata(pa, catalog, table, kinds)
    if catalog is not None:
        return catalog
    return parse_catalog(_text(pa, header, table, kinds, ids), vocab_size=vocab_size, max_items=max_items,
                         max_item_tokens=max_item_tokens)


def _with_metadata(pa: Any, catalog: Any, table: Any, kinds: dict[str, str]) -> Any:
    """``catalog`` with the metadata of the file's other columns, made from the columns
    (:func:`~processors.kinds.tree.catalog.columns.arrow_metadata`: no text per row, no Python object per row); None
    when a value breaks a rule (the NDJSON read then names it)."""
    from processors.kinds.tree.catalog.columns import with_arrow_metadata

    return with_arrow_metadata(catalog, {name: table.column(name) for name, kind in kinds.items() if kind != "null"})


class ParquetShape(NamedTuple):
    """What a Parquet catalog holds, for the manager's memory estimate of its upload (``memory_guard.parquet_need``).
    ``values``: its metadata values (a list's strings one by one, nulls included), 0 when it has no metadata columns;
    ``text``: the bytes of their JSON text besides the strings' own (names, quotes, numbers at their longest);
    ``string_bytes``: the strings' bytes, from the footer their uncompressed size in the file (a dictionary page's
    value once: at most what they decode to), after :func:`parquet_strings` as they decode (once per row that holds
    it); ``strings``: the indices of the columns of strings or lists of strings."""

    rows: int
    ids: int
    values: int = 0
    text: int = 0
    string_bytes: int = 0
    strings: tuple[int, ...] = ()

    @property
    def metadata_bytes(self) -> int:
        """The metadata's JSON text, all rows."""
        return self.text + self.string_bytes


def parquet_shape(data: Any) -> ParquetShape | None:
    """The :class:`ParquetShape` of a Parquet catalog from its footer alone (no column read). None when the file has
    no footer or no ``ids`` column (the read then names the problem); without the metadata figures when a column has
    a type the read refuses before reading."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        source = pq.ParquetFile(pa.BufferReader(data))
        meta, schema = source.metadata, source.schema_arrow
        leaves = [i for i in range(meta.num_columns) if meta.schema.column(i).path.split(".")[0] == IDS]
        if len(leaves) != 1:
            return None
        groups = [meta.row_group(g) for g in range(meta.num_row_groups)]
        rows = int(meta.num_rows)
        shape = ParquetShape(rows, int(sum(group.column(leaves[0]).num_values for group in groups)))
        if len(schema.names) != meta.num_columns:  # a column of several leaves: refused before a column is read
            return shape
        kinds = {i: _kind(pa, name, schema.field(i).type) for i, name in enumerate(schema.names) if name != IDS}
    except ConstraintError:  # a column of another type: refused before a column is read
        return shape
    except Exception:  # noqa: BLE001 - not Parquet: the read refuses it with its reason
        return None
    values = text = string_bytes = 0
    strings = []
    for i, kind in kinds.items():
        if kind == "null":
            continue
        count = sum(int(group.column(i).num_values) for group in groups)
        key = len(json.dumps(schema.names[i], ensure_ascii=False).encode()) + 2  # '"name":' and a comma
        values += count
        if kind in ("str", "list"):
            strings.append(i)
            # (uncompressed: the strings with a 4-byte length each, a dictionary page's once)
            string_bytes += max(0, sum(int(group.column(i).total_uncompressed_size) for group in groups) - 4 * count)
            text += count * (key + 2) if kind == "str" else count * 3 + rows * (key + 2)  # quotes (commas, brackets)
        else:
            text += count * (key + (5 if kind == "bool" else NUMBER_TEXT))
    if values:
        text += 2 * rows  # each row's braces
    return shape._replace(values=values, text=text, string_bytes=string_bytes, strings=tuple(strings))


def parquet_strings(data: Any, shape: ParquetShape) -> ParquetShape:
    """``shape`` (:func:`parquet_shape`) with ``string_bytes`` the string columns' bytes as they decode: those columns
    read as dictionaries a row group at a time (each chunk's dictionary and its indices: no string per row made),
    each value's length counted once per row that holds it. A row whose metadata is, as JSON, over the per-item
    bound (``MetadataLimits.max_item_bytes``, the bound of an NDJSON item) is a 422 naming the row and the limit
    (its strings and names counted, not their escapes: the NDJSON parse counts those)."""
    if not shape.strings:
        return shape
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        footer = pq.ParquetFile(pa.BufferReader(data))
        names = [footer.schema_arrow.names[i] for i in shape.strings]
        paths = [footer.metadata.schema.column(i).path for i in shape.strings]
        source = pq.ParquetFile(pa.BufferReader(data), read_dictionary=paths)
    except Exception:  # noqa: BLE001 - the footer was read: the read names what is wrong
        return shape
    from processors.kinds.tree.filters.metadata import MetadataLimits

    limit = MetadataLimits().max_item_bytes
    keys = [len(json.dumps(name, ensure_ascii=False).encode()) + 1 for name in names]  # '"name":'
    decoded = first = 0
    for g in range(source.num_row_groups):
        try:
            table = source.read_row_group(g, columns=names)
        except Exception as exc:  # noqa: BLE001 - as the read refuses it
            raise _refused(f"the file cannot be read ({str(exc)[:200]})") from None
        size = np.zeros(table.num_rows, dtype=np.int64)
        present = np.zeros(table.num_rows, dtype=np.int64)
        for name, key in zip(names, keys):
            lengths, valid, total = _json_lengths(pa, table.column(name))
            size += np.where(valid, key + lengths, 0)
            present += valid
            decoded += total
        size = np.where(present > 0, size + present + 1, 0)  # the braces, the commas between the fields
        over = np.flatnonzero(size > limit)
        if over.size:
            row = first + int(over[0])
            raise _refused(f"row {row}: its metadata is at least {int(size[over[0]]):,} bytes as JSON, over the limit "
                           f"max_item_bytes={limit}", field="parquet", row=row, limit_name="max_item_bytes",
                           limit=limit)
        first += table.num_rows
    return shape._replace(string_bytes=decoded)


def _json_lengths(pa: Any, column: Any) -> tuple[np.ndarray, np.ndarray, int]:
    """Per row of a string or list-of-strings column: the length of its value's JSON text (the strings' UTF-8 bytes,
    quotes, a list's brackets and commas), whether the row has a value; and the strings' bytes in all."""
    import pyarrow.compute as pc

    lengths, valid, total = [], [], 0
    for chunk in column.chunks:
        if pa.types.is_list(chunk.type) or pa.types.is_large_list(chunk.type):
            entries = _string_lengths(pa, chunk.flatten())
            parents = pc.list_parent_indices(chunk).to_numpy(zero_copy_only=False)
            counts = pc.list_value_length(chunk).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
            per_row = np.bincount(parents, weights=entries + 2, minlength=len(chunk)).astype(np.int64)
            per_row += 2 + np.maximum(counts - 1, 0)
        else:
            entries = _string_lengths(pa, chunk)
            per_row = entries + 2
        total += int(entries.sum())
        lengths.append(per_row)
        valid.append(chunk.is_valid().to_numpy(zero_copy_only=False))
    if not lengths:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool), 0
    return np.concatenate(lengths), np.concatenate(valid), total


def _string_lengths(pa: Any, strings: Any) -> np.ndarray:
    """The UTF-8 length of each string of an array (0 for a null); a dictionary array's looked up in its dictionary."""
    import pyarrow.compute as pc

    if not pa.types.is_dictionary(strings.type):
        return pc.binary_length(strings).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    if not len(strings.dictionary):
        return np.zeros(len(strings), dtype=np.int64)
    by_value = pc.binary_length(strings.dictionary).to_numpy(zero_copy_only=False).astype(np.int64)
    lengths = by_value[strings.indices.fill_null(0).to_numpy(zero_copy_only=False)]
    return np.where(strings.is_valid().to_numpy(zero_copy_only=False), lengths, 0)


def parquet_catalog(data: bytes, *, max_items: int) -> bytes:
    """The NDJSON catalog (:mod:`processors.kinds.tree.catalog.catalog`) a Parquet upload spells. 422 naming the problem: not a Parquet file, no
    header or one the strict parser of the NDJSON header refuses (``config.strict_json.parse_json``: a repeated key,
    ``NaN``, ``1e999``, nested too deep), no ``ids`` column or one that is not a list of integers, a null ``ids`` or
    a null id in one (with its row), a column of another type, more rows than ``max_items``; 415 when pyarrow is not
    installed where the catalog is read."""
    return _text(*_read(data, max_items)[:5])


def _header_line(header: dict) -> bytes:
    return json.dumps(header, separators=(",", ":"), allow_nan=False).encode()


def _read(data: bytes, max_items: int) -> tuple[Any, dict, Any, dict[str, str], Any, np.ndarray]:
    """The file's header, table, metadata columns' kinds, ``ids`` column (one chunk) and its ids, checked."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - a dependency of the package
        raise ConstraintError(415, "a Parquet catalog needs pyarrow on the config manager; upload NDJSON instead",
                              {"field": "body"}) from None
    try:
        source = pq.ParquetFile(pa.BufferReader(data))
        schema = source.schema_arrow
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
        raise _refused(f"not a Parquet file ({str(exc)[:200]})") from None
    rows = source.metadata.num_rows
    if rows > max_items:
        raise _refused(f"{rows:,} rows, over the limit max_tree_keys={max_items:,}", limit_name="max_tree_keys",
                       limit=max_items)
    raw_header = (schema.metadata or {}).get(HEADER_KEY.encode())
    if raw_header is None:
        raise _refused(f"the file's key-value metadata has no {HEADER_KEY!r} entry (the catalog's header: a JSON "
                       "object with start_token_id, end_token_id, ...)", field=f"parquet.{HEADER_KEY}")
    from config.strict_json import BodyRejected, parse_json

    try:  # strict, as the NDJSON header line: no repeated keys, no NaN or 1e999 (a 422, never a 500 later)
        header = parse_json(raw_header, field=f"parquet.{HEADER_KEY}")
    except BodyRejected as error:
        raise _refused(error.reason, field=error.field) from None
    except (ValueError, RecursionError) as exc:
        raise _refused(f"not JSON: {exc}", field=f"parquet.{HEADER_KEY}") from None
    if not isinstance(header, dict):
        raise _refused("must be a JSON object", field=f"parquet.{HEADER_KEY}")
    if IDS not in schema.names:
        raise _refused(f"no {IDS!r} column (each row's token ids, a list of integers)", field=f"parquet.{IDS}")
    ids_type = schema.field(IDS).type
    if not ((pa.types.is_list(ids_type) or pa.types.is_large_list(ids_type) or pa.types.is_fixed_size_list(ids_type))
            and pa.types.is_integer(ids_type.value_type)):
        raise _refused(f"must be a list of integers, got {ids_type}", field=f"parquet.{IDS}")
    kinds = {name: _kind(pa, name, schema.field(name).type) for name in schema.names if name != IDS}
    try:
        table = source.read()
    except Exception as exc:  # noqa: BLE001
        raise _refused(f"the file cannot be read ({str(exc)[:200]})") from None
    ids = table.column(IDS).combine_chunks()
    if ids.null_count:
        first = int(np.flatnonzero(ids.is_null().to_numpy(zero_copy_only=False))[0])
        raise _refused(f"row {first}: null ids", field=f"parquet.{IDS}", row=first)
    flat = ids.flatten()
    if flat.null_count:  # (a null id would read as a number)
        import pyarrow.compute as pc

        at = int(np.flatnonzero(flat.is_null().to_numpy(zero_copy_only=False))[0])
        first = int(pc.list_parent_indices(ids)[at].as_py())
        raise _refused(f"row {first}: a null token id in ids", field=f"parquet.{IDS}", row=first)
    values = flat.to_numpy(zero_copy_only=False)
    if values.size and (values.min() < 0 or values.max() >= 1 << 31):
        raise _refused("token ids must be non-negative 32-bit integers", field=f"parquet.{IDS}")
    return pa, header, table, kinds, ids, values


def _text(pa: Any, header: dict, table: Any, kinds: dict[str, str], ids: Any) -> bytes:
    from processors.kinds.tree.catalog.catalog import list_lines

    texts = list_lines(ids.cast(pa.large_list(pa.int64()))).to_pylist()  # each row's catalog line ("[12,40,7]")
    lines = [_header_line(header).decode()]
    columns = {name: table.column(name).to_pylist() for name, kind in kinds.items() if kind != "null"}
    if not columns:
        lines += texts
    else:
        for row, text in enumerate(texts):
            meta = {name: values_[row] for name, values_ in columns.items() if values_[row] is not None}
            if not meta:
                lines.append(text)
                continue
            try:  # (UTF-8 as it is: the text no larger than the strings, which the memory estimate counts)
                meta_text = json.dumps(meta, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
            except ValueError:
                raise _refused(f"row {row}: a float that is not finite", field="parquet", row=row) from None
            lines.append(f'{{"ids":{text},"metadata":{meta_text}}}')
    return ("\n".join(lines) + "\n").encode()
