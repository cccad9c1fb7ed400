"""A catalog's item lines and their arrays: the lines ``[12,40,7]`` read with array passes (:func:`fast_items`,
in blocks on two threads), written by Arrow's string kernels (:func:`id_lines`, :func:`id_text`, :func:`list_lines`),
and what the arrays of items give per row without a Python object per item (:func:`row_keys`, :func:`offsets_at`).

The items are ``flat`` / ``lengths``: every item's token ids concatenated, and each item's length
(:class:`~processors.kinds.tree.catalog.catalog.Catalog` holds them so)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

__all__ = ["fast_items", "id_lines", "id_text", "list_lines", "offsets_at", "row_keys"]


def offsets_at(sizes: np.ndarray, rows: Any) -> np.ndarray:
    """``concatenate(([0], cumsum(sizes)))[rows]`` for a few ``rows`` (int64, any order), without the cumulative
    array: one ``add.reduceat`` over ``sizes`` between the rows, and a cumulative sum of those few sums."""
    rows = np.asarray(rows, dtype=np.int64)
    if not rows.size:
        return np.zeros(0, dtype=np.int64)
    bounds, at = np.unique(rows, return_inverse=True)
    inside = bounds[bounds < sizes.size]
    cuts = np.concatenate(([0], inside)) if not inside.size or inside[0] else inside
    sums = np.add.reduceat(sizes, cuts, dtype=np.int64) if sizes.size else np.zeros(1, np.int64)
    before = np.zeros(cuts.size + 1, dtype=np.int64)
    np.cumsum(sums, out=before[1:])  # before[i]: the sum of sizes[:cuts[i]]; before[-1]: of all
    cuts_all = np.concatenate((cuts, [sizes.size]))
    return before[np.searchsorted(cuts_all, bounds)][at.ravel()]


_ID_BLOCK = 1 << 22  # ids keyed (row_keys) or written (id_text) at once


def _id_lists(flat: np.ndarray, lengths: np.ndarray) -> Any:
    """The items ``flat`` / ``lengths`` as an Arrow array of integer lists (the ids wrapped, not copied)."""
    import pyarrow as pa

    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat))


def id_lines(flat: np.ndarray, lengths: np.ndarray) -> list[bytes]:
    """Each item's line (``_line``) of the items ``flat`` / ``lengths`` (:func:`list_lines`: 4x a Python loop at 10^6
    items)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    return pc.cast(list_lines(_id_lists(flat, lengths)), pa.large_binary()).to_pylist()


def id_text(flat: np.ndarray, lengths: np.ndarray) -> bytes:
    """Every item's line followed by a newline, as one bytes object: what follows the header in a catalog's content
    (Arrow's string kernels and one copy out of Arrow's buffer, no Python object per item)."""
    return id_text_ends(flat, lengths)[0]


def id_text_ends(flat: np.ndarray, lengths: np.ndarray) -> tuple[bytes, np.ndarray]:
    """:func:`id_text` and where each line ends in it (the offset after its newline, int64): the offsets Arrow made
    the text by, not a second pass over the bytes to find the newlines."""
    if not lengths.size:
        return b"", np.zeros(0, dtype=np.int64)
    if flat.size <= _ID_BLOCK:
        return _id_text(flat, lengths)
    # a block of rows at a time: the kernels' temporaries (a string and an 8-byte offset per id) are a block's, and
    # the parts are joined once (the peak is twice the text, not ~6x)
    texts, ends, at = [], [], 0
    for _, ids, part in _row_blocks(flat, lengths):
        text, block_ends = _id_text(ids, part)
        texts.append(text)
        ends.append(block_ends + at)
        at += len(text)
    return b"".join(texts), np.concatenate(ends)


def _row_blocks(flat: np.ndarray, lengths: np.ndarray):
    """``(first row, its ids, their lengths)`` per block of whole rows of about ``_ID_BLOCK`` ids, in order."""
    per = max(1, _ID_BLOCK // max(int(lengths.max()), 1))
    at = 0
    for lo in range(0, lengths.size, per):
        part = lengths[lo:lo + per]
        size = int(part.sum(dtype=np.int64))
        yield lo, flat[at:at + size], part
        at += size


def _id_text(flat: np.ndarray, lengths: np.ndarray) -> tuple[bytes, np.ndarray]:
    lines = list_lines(_id_lists(flat, lengths), end="]\n")
    offsets = np.frombuffer(lines.buffers()[1], dtype=np.int64, count=len(lines) + 1, offset=8 * lines.offset)
    return lines.buffers()[2][int(offsets[0]):int(offsets[-1])].to_pybytes(), offsets[1:] - offsets[0]


def list_lines(lists: Any, end: str = "]") -> Any:
    """Each row of an Arrow array of integer lists as its catalog line's text (``"[12,40,7]"``, ``_line``; ``end``
    replaces the closing bracket: ``"]\n"`` ends each line), an Arrow ``large_string`` array made by Arrow's string
    kernels (no Python loop per id; 64-bit offsets, so the text of 10^8 items fits)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    text = pa.large_string()
    joined = pc.binary_join(pc.cast(lists, pa.large_list(text)), pa.scalar(",", text))
    return pc.binary_join_element_wise(pa.scalar("[", text), joined, pa.scalar(end, text), pa.scalar("", text))


_TO_SPACE = bytes.maketrans(b"[],\n", b"    ")
_SPACE_IN_NUMBER = re.compile(rb"[0-9][ \t\r]+[0-9]")
_MAX_DIGITS = 9  # token ids are far below 10**9


_BLOCK = 8 << 20  # the item lines are checked in blocks of about this many bytes (cut at newlines), two at a time


def fast_items(body: bytes) -> tuple[list[bytes], np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """``(texts, flat, lengths, keys, ends)`` of the item lines ``body`` when every line is a JSON array of plain decimal
    integers (any spaces between them) or blank, checked with array passes, no Python loop over lines or ids;
    ``texts`` joined are the lines in canonical form (no spaces), each ended by a newline, blank lines dropped;
    ``keys`` each line's :func:`row_keys`, ``ends`` where each line ends in the joined text (after its newline).
    None when anything else is there (the JSON parse then names the problem).

    The lines are read in blocks of about ``_BLOCK`` bytes cut at newlines, on two threads
    (:func:`~processors.kinds.tree.treefile.scan.ordered_map`; numpy releases the GIL in its passes): the passes' temporary
    arrays (several bytes per byte of text) are a block's, not the whole body's, and the blocks stay in cache."""
    from processors.kinds.tree.treefile.scan import ordered_map, release_free_memory

    if b'"' in body:  # strings (items with metadata): no pass over the spaces (a regex pass of ~2 s at 10^6 items)
        return None
    if b" " in body or b"\t" in body or b"\r" in body:  # (a canonical upload has none: no regex pass over it)
        if _SPACE_IN_NUMBER.search(body):
            return None
        body = body.translate(None, b" \t\r")
    if body.translate(None, b"0123456789[],\n"):
        return None  # other characters: strings, floats, negative numbers, nested values, ...
    bounds = []
    pos = 0
    while pos < len(body):
        end = body.find(b"\n", pos + _BLOCK)
        end = len(body) if end < 0 else end + 1
        bounds.append((pos, end))
        pos = end
    view = memoryview(body)
    texts: list[bytes] = []
    flats: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    keys: list[np.ndarray] = []
    ends: list[np.ndarray] = []
    at = 0
    for part in ordered_map(lambda span: _fast_block(view[span[0]:span[1]]), bounds):
        if part is None:
            return None
        texts.append(part[0])
        flats.append(part[1])
        lengths.append(part[2])
        keys.append(part[3])
        ends.append(part[4] + at)
        at += len(part[0])
    if len(bounds) > 1:
        release_free_memory()  # (the blocks' temporaries, freed in the workers' arenas)
    if not texts:
        return [], np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.uint64), np.zeros(0, np.int64)
    return texts, np.concatenate(flats), np.concatenate(lengths), np.concatenate(keys), np.concatenate(ends)


def _fast_block(block: memoryview) -> tuple[bytes, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """:func:`fast_items` of one block of whole lines (no spaces left in it, only digits, brackets, commas and
    newlines)."""
    a = np.frombuffer(block, dtype=np.uint8)
    if not a.size or a[-1] != 10:
        a = np.append(a, np.uint8(10))  # (the body's last line, without its newline)
    newline = a == 10
    blank = newline.copy()  # a blank line's newline: first in the block, or right after another one
    blank[1:] &= newline[:-1]
    if blank.any():  # dropped: each line then ends with exactly one newline
        a = a[~blank]
    nl = np.flatnonzero(a == 10)
    starts = np.empty(nl.size, dtype=np.int64)
    if nl.size:
        starts[0] = 0
        starts[1:] = nl[:-1] + 1
    if not nl.size:
        return b"", np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.uint64), np.zeros(0, np.int64)
    opens, closes, commas = (a == 91), (a == 93), (a == 44)
    # one '[' first and one ']' last per line, nothing else but digits and commas in between
    if not (opens[starts].all() and closes[nl - 1].all()):
        return None
    if int(np.count_nonzero(opens)) != starts.size or int(np.count_nonzero(closes)) != starts.size:
        return None
    is_digit = (a >= 48) & (a <= 57)
    # every '[' and ',' is followed by a digit, every ']' and ',' preceded by one: no [], [,1], [1,,2], [1,]
    before_digit = opens | commas
    if not is_digit[1:][before_digit[:-1]].all():
        return None
    after_digit = closes | commas
    if not is_digit[:-1][after_digit[1:]].all():
        return None
    # numbers: runs of digits; no leading zeros, at most _MAX_DIGITS digits
    edge = np.diff(is_digit.view(np.int8), prepend=np.int8(0))
    run_start, run_end = np.flatnonzero(edge == 1), np.flatnonzero(edge == -1)
    if run_start.size != run_end.size:
        return None
    run_len = run_end - run_start
    if run_len.max() > _MAX_DIGITS or ((a[run_start] == 48) & (run_len > 1)).any():
        return None
    text = a.tobytes()
    flat = np.fromstring(text.translate(_TO_SPACE), dtype=np.int64, sep=" ")  # noqa: NPY201 - text mode
    if flat.size != run_start.size:
        return None
    lengths = np.add.reduceat(commas, starts, dtype=np.int32) + 1  # ids per line: its commas and one
    flat = flat.astype(np.int32)  # (at most _MAX_DIGITS digits: below 2^31)
    return text, flat, lengths, row_keys(flat, lengths), nl + 1


_MULT = np.uint64(0x9E3779B97F4A7C15)  # odd: its powers weigh each position of a row


def row_keys(flat: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """A 64-bit key per row of ``flat`` / ``lengths`` (uint64): its ids and length hashed, with array passes over the
    ids only (a polynomial in the ids, wrapping, then mixed). Equal rows have equal keys; unequal rows almost never
    do, and whoever looks rows up by key compares the ids of the few that match anyway. Rows of more than
    ``_ID_BLOCK`` ids in all are keyed a block of rows at a time (the passes' temporaries are 8-24 bytes per id)."""
    if flat.size > _ID_BLOCK and lengths.size > 1:
        out = np.empty(lengths.size, dtype=np.uint64)
        for lo, ids, part in _row_blocks(flat, lengths):
            out[lo:lo + part.size] = _row_keys(ids, part)
        return out
    return _row_keys(flat, lengths)


def _row_keys(flat: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    n = lengths.size
    out = lengths.astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
    if not flat.size:
        return out
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    powers = np.cumprod(np.full(int(lengths.max()), _MULT, dtype=np.uint64))
    terms = flat.astype(np.uint64) + np.uint64(1)
    terms *= powers[np.arange(flat.size, dtype=np.int64) - np.repeat(starts, lengths)]
    filled = lengths > 0
    out[filled] += np.add.reduceat(terms, starts[filled])
    out ^= out >> np.uint64(31)  # (a 64-bit finalizer: the low bits, which pick the buckets, depend on every id)
    out *= np.uint64(0x94D049BB133111EB)
    out ^= out >> np.uint64(29)
    return out
