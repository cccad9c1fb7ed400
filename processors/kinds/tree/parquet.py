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
needs), any other through the catalog's NDJSON form (:func:`parquet_catalog`, :mod:`.catalog`), parsed like any
upload: one set of rules and limits. The row count and the
columns' types are checked from the file's footer before any column is read.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from config import ConstraintError
from config.echo import shown_name

__all__ = ["HEADER_KEY", "PARQUET_CONTENT_TYPES", "parquet_catalog", "parquet_items", "parquet_shape"]

#: request content types read as a Parquet catalog (the first is the registered one)
PARQUET_CONTENT_TYPES = ("application/vnd.apache.parquet", "application/x-parquet")
#: the key of the file's key-value metadata that holds the catalog's header (a JSON object)
HEADER_KEY = "catalog"
IDS = "ids"


def _refused(message: str, field: str = "body", **detail: Any) -> ConstraintError:
    return ConstraintError(422, f"{field}: {message}", {"field": field, **detail})


def _kind(pa: Any, column: str, typ: Any) -> str:
    """The metadata kind of a column's Arrow type: ``str``, ``bool``, ``int``, ``float`` or ``list`` (of strings)."""
    if pa.types.is_null(typ):  # every row null: no item has the field
        return "null"
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        return "str"
    if pa.types.is_boolean(typ):
        return "bool"
    if pa.types.is_integer(typ):
        return "int"
    if pa.types.is_floating(typ):
        return "float"
    if (pa.types.is_list(typ) or pa.types.is_large_list(typ)) and (
            pa.types.is_string(typ.value_type) or pa.types.is_large_string(typ.value_type)):
        return "list"
    raise _refused(f"column {shown_name(column)!r} has type {typ}; metadata columns are strings, booleans, integers, "
                   "floats or lists of strings", field=f"parquet.{shown_name(column)}")


def parquet_items(data: bytes, *, vocab_size: int, max_items: int, max_item_tokens: int | None = None):
    """The parsed catalog (:class:`~.catalog.Catalog`) of a Parquet upload. A file without metadata columns goes
    straight from its ``ids`` column to the catalog's arrays (:func:`~.catalog_parse.catalog_from_arrays`: no item text made
    or parsed, no Python object per row); a file with metadata, or one with an item that breaks a rule (named by its
    line), is read as the NDJSON it spells (:func:`parquet_catalog`) and parsed. Refusals as there."""
    from .catalog_parse import catalog_from_arrays, parse_catalog

    import pyarrow.compute as pc

    pa, header, table, kinds, ids, values = _read(data, max_items)
    if not any(kind != "null" for kind in kinds.values()):
        lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False)
        catalog = catalog_from_arrays(_header_line(header), values, lengths, vocab_size=vocab_size,
                                      max_items=max_items, max_item_tokens=max_item_tokens)
        if catalog is not None:
            return catalog
    return parse_catalog(_text(pa, header, table, kinds, ids), vocab_size=vocab_size, max_items=max_items,
                         max_item_tokens=max_item_tokens)


def parquet_shape(data: bytes) -> tuple[int, int] | None:
    """``(rows, ids)`` of a Parquet catalog from its footer alone (no column read): what the manager's memory estimate
    of the upload reads. None when the file has no footer or no ``ids`` column (the read then names the problem)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(pa.BufferReader(data)).metadata
        leaves = [i for i in range(meta.num_columns) if meta.schema.column(i).path.split(".")[0] == IDS]
        if len(leaves) != 1:
            return None
        ids = sum(meta.row_group(g).column(leaves[0]).num_values for g in range(meta.num_row_groups))
        return int(meta.num_rows), int(ids)
    except Exception:  # noqa: BLE001 - not Parquet: the read refuses it with its reason
        return None


def parquet_catalog(data: bytes, *, max_items: int) -> bytes:
    """The NDJSON catalog (:mod:`.catalog`) a Parquet upload spells. 422 naming the problem: not a Parquet file, no
    header, no ``ids`` column or one that is not a list of integers, a null ``ids``, a column of another type, more
    rows than ``max_items``; 415 when pyarrow is not installed where the catalog is read."""
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
    try:
        header = json.loads(raw_header)
    except ValueError as exc:
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
    values = ids.flatten().to_numpy(zero_copy_only=False)
    if values.size and (values.min() < 0 or values.max() >= 1 << 31):
        raise _refused("token ids must be non-negative 32-bit integers", field=f"parquet.{IDS}")
    return pa, header, table, kinds, ids, values


def _text(pa: Any, header: dict, table: Any, kinds: dict[str, str], ids: Any) -> bytes:
    from .catalog import list_lines

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
            try:
                lines.append(f'{{"ids":{text},"metadata":{json.dumps(meta, separators=(",", ":"), allow_nan=False)}}}')
            except ValueError:
                raise _refused(f"row {row}: a float that is not finite", field="parquet", row=row) from None
    return ("\n".join(lines) + "\n").encode()
