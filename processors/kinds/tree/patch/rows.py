"""Finding a catalog's rows by item, for a PATCH (:mod:`processors.kinds.tree.patch.items`): a 64-bit key per row
(:func:`catalog_row_keys`, ``item_lines.row_keys`` of its ids, made once per catalog), and either the sorted index of
those keys of a large catalog (:func:`index_row_keys`: two binary searches per wanted item) or one pass over every
row's key against a table of the wanted keys' flags (:func:`_scanned_rows`); rows whose keys collide are told apart
by their ids (:func:`rows_of`)."""

from __future__ import annotations

import numpy as np

from processors.kinds.tree.catalog.catalog import Catalog, catalog_row_keys, row_keys

__all__ = ["INDEX_MAX_ROWS", "INDEX_ROWS", "catalog_row_keys", "index_row_keys", "row_keys", "rows_of"]

_BUCKET_BITS = 22  # the wanted rows' keys marked in a table of 2^22 flags (4 MiB): one gather over every row
_SCAN_BLOCK = 1 << 16  # rows' keys gathered a block at a time


#: a catalog of at least this many rows (and at most INDEX_MAX_ROWS) gets a sorted index of its row keys, 8 bytes a
#: row (:func:`index_row_keys`), made once its tables are (a PUT, a manager's restart) or at its first lookup (a new
#: base a PATCH wrote out): a PATCH then finds its items by binary search instead of a pass over every row's key
#: (0.2-0.3 s at 10^7 rows in the service). Above INDEX_MAX_ROWS the 8 bytes a row are not spent (at 10^8 items they
#: would be 0.8 GB beside the manager's 11 GB peak): the pass it is.
INDEX_ROWS = 1 << 21
INDEX_MAX_ROWS = 1 << 26


def _index_bits(rows: int) -> int:
    return max(1, (rows - 1).bit_length())


def index_row_keys(catalog: Catalog) -> np.ndarray | None:
    """The key index of a written-out ``catalog`` of :data:`INDEX_ROWS` to :data:`INDEX_MAX_ROWS` rows (else None),
    made once: every row's key (:func:`catalog_row_keys`) with its low bits replaced by the row's number, sorted.
    A key's rows are then the entries between its high bits with the low bits all 0 and all 1."""
    if catalog._key_index is not None or catalog._pending is not None:
        return catalog._key_index
    rows = len(catalog._lengths)
    if not INDEX_ROWS <= rows <= INDEX_MAX_ROWS:
        return None
    low = np.uint64((1 << _index_bits(rows)) - 1)
    index = np.bitwise_and(catalog_row_keys(catalog), ~low)
    for lo in range(0, rows, _SCAN_BLOCK):  # (no row-number array the size of the catalog)
        part = index[lo:lo + _SCAN_BLOCK]
        part |= np.arange(lo, lo + part.size, dtype=np.uint64)
    index.sort()
    catalog._key_index = index
    return index


def _indexed_rows(index: np.ndarray, rows: int, wanted: np.ndarray) -> np.ndarray:
    """The rows whose key shares its high bits with one of ``wanted`` (a superset of those whose key is one of them),
    found by two binary searches per wanted key in :func:`index_row_keys`'s ``index`` of a ``rows``-row catalog."""
    low = np.uint64((1 << _index_bits(rows)) - 1)
    high = wanted & ~low
    first, last = np.searchsorted(index, high, "left"), np.searchsorted(index, high | low, "right")
    counts = last - first
    at = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(first - (np.cumsum(counts) - counts), counts)
    return (index[at] & low).view(np.int64)


def rows_of(catalog: Catalog, items: list[tuple[int, ...]]) -> dict[tuple[int, ...], int]:
    """``{item: row}`` for the ``items`` that ``catalog`` holds, without a Python test of every row or a set of them
    all: the rows whose key (:func:`catalog_row_keys`) is one of ``items``' keys, found in the key index of a large
    catalog (:func:`index_row_keys`), else with one gather of every row's bucket flag; only their ids (about as many
    rows as ``items``) are compared."""
    if not items:
        return {}
    code = catalog_row_keys(catalog)
    want = Catalog.from_items(0, 0, items)
    wanted = row_keys(want.flat, want.lengths)
    index = index_row_keys(catalog)
    if index is not None:
        rows = _indexed_rows(index, code.size, wanted)
    else:
        rows = _scanned_rows(code, wanted)
    rows = rows[np.isin(code[rows], wanted)].tolist()
    mine = set(items)
    return {item: row for row, item in zip(rows, catalog.rows(rows)) if item in mine}


def _scanned_rows(code: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """The rows whose key (``code``) falls in the bucket of one of ``wanted``'s: a gather of every row's flag in a
    table of 2^22 flags, a block of keys at a time into the same two buffers (no temporaries the size of the
    catalog: half the time of the whole-array gather at 10^7 rows)."""
    mask = np.uint64((1 << _BUCKET_BITS) - 1)
    flags = np.zeros(1 << _BUCKET_BITS, dtype=bool)
    flags[(wanted & mask).view(np.int64)] = True
    found = []
    block = min(code.size, _SCAN_BLOCK)
    buckets, hits = np.empty(block, dtype=np.uint64), np.empty(block, dtype=bool)
    for lo in range(0, code.size, _SCAN_BLOCK):
        part = code[lo:lo + _SCAN_BLOCK]
        at = np.flatnonzero(np.take(flags, np.bitwise_and(part, mask, out=buckets[:part.size]).view(np.int64),
                                    out=hits[:part.size]))
        if at.size:
            found.append(at + lo)
    return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
