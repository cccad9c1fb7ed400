"""The vectorized half of the tree loader: key paths as hashes, and a numpy scan of tree files.

Two pieces, both array passes with no Python loop over keys or candidates:

* :func:`parse_keys` reads a block of keys (their UTF-8 bytes, each ended by ``\\x00``, the separator mapped to
  ``\\x01``) and returns, per key, its number of parts, its first part, whether it needs the exact per-key check
  (anything but canonical decimal parts), whether a later part is past the vocabulary, and two independent 64-bit
  hashes of its parts. The table builder (``processors.tables``) finds the state after ``key --t-->`` by extending
  the key's hashes with ``t`` (:func:`extend_hash`) and looking them up among the keys' hashes: no strings are
  built, and no dict of keys is held.
* :func:`scan_tree_file` reads a tree file in blocks of :data:`CHUNK_BYTES` and returns its top-level fields, the
  raw key bytes and the candidate ids, or ``None`` when the file has anything the scan does not handle (escapes,
  non-ASCII text, floats, ``true``, nested values, numbers of 19 digits or more, invalid JSON): the loader then
  parses it with ijson, which names every problem. The scan checks the complete grammar of what it accepts, so a
  file it accepts is valid JSON with that exact content.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
from collections import deque
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from config.cancel import checkpoint

__all__ = ["CHUNK_BYTES", "SCAN_THREADS", "KeyBlock", "ScannedTree", "extend_hash", "ordered_map",
           "parse_keys", "scan_tree_bytes", "scan_tree_file"]

CHUNK_BYTES = 8 << 20


def _scan_threads() -> int:
    """Threads that read the blocks of one large tree at once (numpy releases the GIL in its array passes): two, or
    the environment variable CONSTRAINED_SERVE_SCAN_THREADS (1: read on the calling thread alone)."""
    value = os.environ.get("CONSTRAINED_SERVE_SCAN_THREADS", "").strip()
    return max(1, int(value)) if value.isdigit() else max(1, min(2, os.cpu_count() or 1))


SCAN_THREADS = _scan_threads()
SEED = (np.uint64(0x243F6A8885A308D3), np.uint64(0x13198A2E03707344))
_K1, _K2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xD6E8FEB86659FD93)
_M1A, _M1B = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_M2A, _M2B = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)
_S27, _S30, _S31, _S33 = np.uint64(27), np.uint64(30), np.uint64(31), np.uint64(33)
_MAX_DIGITS = 18  # every number of at most 18 digits fits an int64
_POW10 = 10 ** np.arange(_MAX_DIGITS + 1, dtype=np.int64)


_T = TypeVar("_T")
_R = TypeVar("_R")


def ordered_map(fn: Callable[[_T], _R], items: Iterable[_T], threads: int | None = None) -> Generator[_R, None, None]:
    """``map(fn, items)`` on ``threads`` (default :data:`SCAN_THREADS`) worker threads, results in order, at most
    two per thread in flight (their inputs and outputs are what is held beyond a plain ``map``).

    The workers are started by the calling thread and so run at its priority: the config manager's niced compile
    threads stay niced. An exception of ``fn`` is raised where its result is taken."""
    threads = SCAN_THREADS if threads is None else threads
    if threads < 2:
        for item in items:
            checkpoint()
            yield fn(item)
        return
    pool = ThreadPoolExecutor(threads, thread_name_prefix="tree-scan")
    try:
        pending: deque = deque()
        for item in items:
            checkpoint()  # a compile stopped at its time limit ends here, between blocks
            pending.append(pool.submit(fn, item))
            if len(pending) >= 2 * threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:  # also when the taker stops early: what was not started is dropped
        pool.shutdown(wait=True, cancel_futures=True)


def release_free_memory() -> None:
    """Give the memory freed by large array passes back to the OS (glibc's ``malloc_trim``; nothing elsewhere).

    Blocks read on worker threads allocate in those threads' malloc arenas, and glibc raises its mmap threshold
    after large frees, so the temporaries of a parse of hundreds of MB stay in the process's RSS once freed (about
    400 MB after a 10^7-item catalog, measured) until something trims them."""
    global _TRIM
    if _TRIM is None:
        try:
            import ctypes

            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM: Any = None


def extend_hash(h1: np.ndarray, h2: np.ndarray, part: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The hashes of the paths ``h + [part]`` (elementwise): two different mixers over ``h * K + part + 1``.

    Each step is a bijection of the 64-bit state for a fixed ``part``, so two paths that differ get different
    values unless the 64-bit states collide; the two hashes together make that chance negligible.
    """
    p = part.astype(np.uint64) + np.uint64(1)
    z = h1 * _K1 + p
    z ^= z >> _S30
    z *= _M1A
    z ^= z >> _S27
    z *= _M1B
    z ^= z >> _S31
    y = h2 * _K2 + p
    y ^= y >> _S33
    y *= _M2A
    y ^= y >> _S33
    y *= _M2B
    y ^= y >> _S33
    return z, y


def _decimal_values(a: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The values of the decimal digit runs ``a[starts[i] : starts[i] + lengths[i]]`` (runs longer than 18 digits
    give garbage and are flagged by the callers).

    Runs of up to 8 digits (every token id) are read 8 bytes at a time: the 8 bytes ending at the run's end as one
    little-endian uint64, the bytes before the run set to '0', then the three multiply-shift steps that turn 8
    ASCII digits into their value (as in simdjson). Longer runs use Horner's rule, one pass per digit."""
    values = np.zeros(starts.size, dtype=np.int64)
    if not starts.size or not a.size:
        return values
    padded = np.zeros(a.size + 8, dtype=np.uint8)
    padded[8:] = a
    short = lengths <= 8
    idx = np.flatnonzero(short)
    if idx.size:
        ends = (starts[idx] + lengths[idx]).astype(np.int64)  # exclusive, in a; windows over padded end there
        word = _words(padded, ends)
        fill = (np.uint64(8) - lengths[idx].astype(np.uint64)) * np.uint64(8)  # bits of bytes before the run
        low = np.where(fill >= np.uint64(64), np.uint64(0xFFFFFFFFFFFFFFFF),
                       (np.uint64(1) << np.minimum(fill, np.uint64(63))) - np.uint64(1))
        word = (word & ~low) | (np.uint64(0x3030303030303030) & low)
        word = ((word & np.uint64(0x0F0F0F0F0F0F0F0F)) * np.uint64(2561)) >> np.uint64(8)
        word = ((word & np.uint64(0x00FF00FF00FF00FF)) * np.uint64(6553601)) >> np.uint64(16)
        word = ((word & np.uint64(0x0000FFFF0000FFFF)) * np.uint64(42949672960001)) >> np.uint64(32)
        values[idx] = word.astype(np.int64)
    idx = np.flatnonzero(~short)
    if idx.size:
        last = a.size - 1
        st, ln = starts[idx], lengths[idx]
        v = np.zeros(idx.size, dtype=np.int64)
        for k in range(int(min(ln.max(), _MAX_DIGITS + 1))):
            digit = a[np.minimum(st + k, last)].astype(np.int64) - 48
            v = np.where(ln > k, v * 10 + digit, v)
        values[idx] = v
    return values


def _words(padded: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The 8 bytes of ``padded`` ending at ``ends + 8`` (``padded`` has 8 leading zero bytes) as little-endian
    uint64 values: a view with an 8-byte item at every byte offset, gathered at ``ends``."""
    every_offset = np.ndarray(shape=(padded.size - 7,), dtype="<u8", buffer=padded, strides=(1,))
    return every_offset[ends]


@dataclass
class KeyBlock:
    """Per key of a block: see :func:`parse_keys`."""

    n_parts: np.ndarray  # int32; 0 where ``odd``
    first: np.ndarray  # int64 first part; -1 where ``odd``
    odd: np.ndarray  # bool: not canonical decimal parts (or a part of 19+ digits): needs the exact check
    over_vocab: np.ndarray  # bool: a part after the first is >= vocab_size
    max_later: np.ndarray  # int64: the largest part after the first (-1: none, or ``odd``)
    h1: np.ndarray  # uint64 hashes of all parts (0 where ``odd``)
    h2: np.ndarray


def parse_keys(blob: np.ndarray, vocab_size: int | None) -> KeyBlock:
    """Parse a block of keys: ``blob`` is uint8, each key ended by 0, the separator mapped to 1."""
    a = blob
    term = a == 0
    n = int(np.count_nonzero(term))
    bound = term | (a == 1)
    digit = (a - np.uint8(48)) < 10
    bpos = np.flatnonzero(bound)  # one boundary per part: the part ends there
    seg_start = np.empty_like(bpos)
    if bpos.size:
        seg_start[0] = 0
        seg_start[1:] = bpos[:-1] + 1
    seg_len = bpos - seg_start
    ends_key = term[bpos]
    seg_key = np.cumsum(ends_key) - ends_key
    n_parts = np.bincount(seg_key, minlength=n).astype(np.int32)
    lead = a[np.minimum(seg_start, a.size - 1)] if a.size else a
    seg_odd = (seg_len == 0) | (seg_len > _MAX_DIGITS) | ((seg_len > 1) & (lead == 48))
    odd = np.bincount(seg_key[seg_odd], minlength=n) > 0
    other = np.flatnonzero(~(digit | bound))
    if other.size:
        odd[np.searchsorted(np.flatnonzero(term), other)] = True
    values = _decimal_values(a, seg_start, seg_len)
    first_seg = np.cumsum(n_parts, dtype=np.int64) - n_parts
    first = np.where(odd, -1, values[first_seg] if bpos.size else np.zeros(n, dtype=np.int64))
    over_vocab = np.zeros(n, dtype=bool)
    if vocab_size is not None and bpos.size:
        later = np.ones(bpos.size, dtype=bool)
        later[first_seg] = False
        over_vocab = np.bincount(seg_key[later & (values >= vocab_size)], minlength=n) > 0
        over_vocab &= ~odd
    max_later = np.full(n, -1, dtype=np.int64)
    if bpos.size:
        later_values = values.copy()
        later_values[first_seg] = -1
        max_later = np.maximum.reduceat(later_values, first_seg) if n else max_later
        max_later[odd] = -1
        del later_values
    n_parts[odd] = 0
    # Level j extends the hashes of the keys with more than j parts. With the keys sorted by part count, longest
    # first, those keys are a prefix of the sorted arrays: each level works on slices, with one gather of parts.
    order = np.argsort(-n_parts, kind="stable")
    counts = np.bincount(n_parts)
    longer = n - np.cumsum(counts)  # keys with more than j parts
    firsts = first_seg[order]
    s1 = np.full(n, SEED[0], dtype=np.uint64)
    s2 = np.full(n, SEED[1], dtype=np.uint64)
    for j in range(1, counts.size):
        m = int(longer[j - 1])
        if m == 0:
            break
        s1[:m], s2[:m] = extend_hash(s1[:m], s2[:m], values[firsts[:m] + (j - 1)])
    del firsts, values
    h1 = np.empty(n, dtype=np.uint64)
    h2 = np.empty(n, dtype=np.uint64)
    h1[order] = s1
    h2[order] = s2
    h1[odd] = 0
    h2[odd] = 0
    return KeyBlock(n_parts, first, odd, over_vocab, max_later, h1, h2)


# ------------------------------------------------------------------------------------------------ file scan

_WS = re.compile(rb"[ \t\n\r]*")
_SCALAR = re.compile(rb"(-?(?:0|[1-9][0-9]{0,17}))(?![0-9.eE])|(true|false|null)\b")
_LITERALS = {b"true": True, b"false": False, b"null": None}
_S, _N = 1, 2
_COMMA, _COLON, _OPEN, _CLOSE = ord(","), ord(":"), ord("["), ord("]")
_CLASS = np.zeros(256, dtype=np.uint8)  # 1 whitespace, 2 digit or '-', 3 structure, 4 quote; 0 anything else
_CLASS[[32, 9, 10, 13]] = 1
_CLASS[48:58] = 2
_CLASS[45] = 2
_CLASS[[_COMMA, _COLON, _OPEN, _CLOSE, ord("}")]] = 3
_CLASS[83] = 3  # "S": a string, in the text outside strings


class _Unhandled(Exception):
    """The scan does not handle this file: parse it with ijson."""


@dataclass
class ScannedTree:
    """What :func:`scan_tree_file` read: top-level fields (``prefix_dict`` as True), key blocks (raw bytes, each
    key ended by 0), candidate ids and the number of candidates per key."""

    fields: dict[str, Any]
    duplicate_fields: list[str]
    key_blocks: list[bytes]
    candidates: np.ndarray
    counts: np.ndarray


def scan_tree_file(path: str) -> ScannedTree | None:
    """Scan a tree file with numpy, or return None when the ijson parser must read it (see the module doc)."""
    with open(path, "rb") as handle:
        try:
            mm = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file
            return None
    try:
        return _scan(mm)
    except _Unhandled:
        return None
    finally:
        mm.close()


def scan_tree_bytes(data: bytes) -> ScannedTree | None:
    """:func:`scan_tree_file` over a tree held in memory (the value of an inline ``tree`` cut out of a scenario
    body by :func:`config.json_span.object_field_span`)."""
    if not data:
        return None
    try:
        return _scan(data)
    except _Unhandled:
        return None


def _scan(mm: mmap.mmap | bytes) -> ScannedTree:
    pos = _WS.match(mm, 0).end()  # type: ignore[union-attr]
    if mm[pos : pos + 1] != b"{":
        raise _Unhandled
    pos += 1
    out = ScannedTree({}, [], [], np.zeros(0, np.int64), np.zeros(0, np.int64))
    cands: list[np.ndarray] = []
    counts: list[np.ndarray] = []
    first_field = True
    while True:
        pos = _WS.match(mm, pos).end()  # type: ignore[union-attr]
        if first_field and mm[pos : pos + 1] == b"}":
            pos += 1
            break
        if mm[pos : pos + 1] != b'"':
            raise _Unhandled
        end = mm.find(b'"', pos + 1)
        raw = mm[pos + 1 : end] if end > 0 else b"\\"
        if b"\\" in raw or any(c < 32 or c > 126 for c in raw):
            raise _Unhandled
        name = raw.decode("ascii")
        pos = _WS.match(mm, end + 1).end()  # type: ignore[union-attr]
        if mm[pos : pos + 1] != b":":
            raise _Unhandled
        pos = _WS.match(mm, pos + 1).end()  # type: ignore[union-attr]
        if name in out.fields:
            out.duplicate_fields.append(name)
        if name == "prefix_dict" and mm[pos : pos + 1] == b"{":
            pos = _scan_prefix_dict(mm, pos + 1, out.key_blocks, cands, counts)
            out.fields[name] = True
        else:
            value, pos = _scalar(mm, pos)
            out.fields[name] = value
        first_field = False
        pos = _WS.match(mm, pos).end()  # type: ignore[union-attr]
        sep = mm[pos : pos + 1]
        pos += 1
        if sep == b"}":
            break
        if sep != b",":
            raise _Unhandled
    if _WS.match(mm, pos).end() != len(mm):  # type: ignore[union-attr]
        raise _Unhandled
    out.candidates = np.concatenate(cands) if cands else np.zeros(0, np.int64)
    out.counts = np.concatenate(counts) if counts else np.zeros(0, np.int64)
    return out


def _scalar(mm: mmap.mmap | bytes, pos: int) -> tuple[Any, int]:
    if mm[pos : pos + 1] == b'"':
        end = mm.find(b'"', pos + 1)
        raw = mm[pos + 1 : end] if end > 0 else b"\\"
        if b"\\" in raw or any(c < 32 or c > 126 for c in raw):
            raise _Unhandled
        return raw.decode("ascii"), end + 1
    m = _SCALAR.match(mm, pos)
    if m is None:
        raise _Unhandled
    if m.group(1) is not None:
        return int(m.group(1)), m.end()
    return _LITERALS[m.group(2)], m.end()


def _scan_prefix_dict(mm: mmap.mmap | bytes, start: int, blocks: list[bytes], cands: list[np.ndarray],
                      counts: list[np.ndarray]) -> int:
    """Scan the prefix_dict object from just after its ``{``; return the position after its ``}``.

    The text is cut into blocks of about :data:`CHUNK_BYTES` at ``],`` (between two entries) and the blocks are
    read on :data:`SCAN_THREADS` threads (:func:`ordered_map`), their results taken in order up to the block where
    the object ends; what comes after that block is the caller's to read."""
    size = len(mm)
    bounds = []
    cur = start
    while True:
        cut = mm.find(b"],", cur + CHUNK_BYTES) if cur + CHUNK_BYTES < size else -1
        stop = size if cut < 0 else cut + 1
        bounds.append((cur, stop))
        if cut < 0:
            break
        cur = stop

    def read(index: int):
        lo, hi = bounds[index]
        out: tuple[list[bytes], list[np.ndarray], list[np.ndarray]] = ([], [], [])
        try:
            return out, _scan_block(mm[lo:hi], index == 0, *out)
        except _Unhandled as error:  # for the taker to raise, unless the object ended in an earlier block
            return out, error

    # closed on the way out, whichever way that is: no worker still reads the mapped file once this returns
    with contextlib.closing(ordered_map(read, range(len(bounds)))) as results:
        for index, (out, end) in enumerate(results):
            if isinstance(end, _Unhandled):
                raise end
            blocks.extend(out[0])
            cands.extend(out[1])
            counts.extend(out[2])
            if end is not None:
                return bounds[index][0] + end + 1
    raise _Unhandled  # no closing brace


def _scan_block(buf: bytes, first: bool, blocks: list[bytes], cands: list[np.ndarray],
                counts: list[np.ndarray]) -> int | None:
    """One block of ``"key": [ids], ...`` entries (later blocks start at the ``,`` between two entries). Appends
    the keys and candidates; returns the offset of the closing ``}`` when the object ends in this block.

    Splitting at the quotes (no escapes here) gives the strings at odd places; joining the rest with ``S`` gives
    the text outside strings with each string as one ``S``, which numpy then checks and reads."""
    if b"\\" in buf:
        raise _Unhandled
    parts = buf.split(b'"')
    gaps = parts[0::2]
    outer = b"S".join(gaps)
    end = None
    brace = outer.find(b"}")
    if brace >= 0:  # the object ends in this block: keep what comes before its closing brace
        n_strings = outer.count(b"S", 0, brace)
        before = sum(map(len, parts[: 2 * n_strings])) + 2 * n_strings  # the bytes and quotes of earlier parts
        end = before + (brace - (outer.rfind(b"S", 0, brace) + 1 if n_strings else 0))
        parts = parts[: 2 * n_strings + 1]
        outer = outer[:brace]
    elif len(parts) % 2 == 0:
        raise _Unhandled  # a string runs past the block
    keys = parts[1::2]
    blob = b"\x00".join(keys) + b"\x00" if keys else b""
    text = np.frombuffer(blob, dtype=np.uint8)
    if np.count_nonzero(text < 32) != len(keys) or (text > 126).any():
        raise _Unhandled  # control characters or non-ASCII text: the ijson parser reads those
    if outer.count(b"S") != len(keys):
        raise _Unhandled  # an S outside strings: not JSON
    a = np.frombuffer(outer, dtype=np.uint8)
    cls = _CLASS[a]
    if (cls == 0).any():
        raise _Unhandled  # '.', 'e', 't', '{', ... outside strings
    num = cls == 2
    num_start = num.copy()
    num_start[1:] &= ~num[:-1]
    num_end = num.copy()
    num_end[:-1] &= ~num[1:]
    # tokens in order: S (a string), N (a number), and the structural characters
    code = np.where(cls >= 3, a, 0).astype(np.uint8)
    code[code == 83] = _S
    code[num_start] = _N
    t = code[code != 0]
    if first and t.size:
        t = np.concatenate([np.array([_COMMA], np.uint8), t])
    if t.size:
        _check_grammar(t)
    # numbers: '-' only first, at least one digit, no leading zero, at most 18 digits
    starts, ends = np.flatnonzero(num_start), np.flatnonzero(num_end)
    minus = a[starts] == 45
    digits_from = starts + minus
    lengths = ends + 1 - digits_from
    if (lengths < 1).any() or (lengths > _MAX_DIGITS).any():
        raise _Unhandled
    if outer.count(b"-") != np.count_nonzero(minus):
        raise _Unhandled  # a '-' inside a number
    if ((lengths > 1) & (a[np.minimum(digits_from, a.size - 1)] == 48)).any():
        raise _Unhandled
    values = _decimal_values(a, digits_from, lengths)
    values[minus] *= -1
    # candidates per key, from the grammar: an entry ", S : [ N , N ... ]" with c ids spans 2c + 4 tokens (5 when
    # empty) up to the next entry's comma
    s_at = np.flatnonzero(t == _S)
    span = np.diff(np.append(s_at, t.size + 1))
    blocks.append(blob)
    cands.append(values)
    counts.append(np.where(span > 5, (span - 4) // 2, 0).astype(np.int64))
    return end


def _check_grammar(t: np.ndarray) -> None:
    """``t``: the token codes of ``(, S : [ (N (, N)*)? ])*``; raise :class:`_Unhandled` on anything else."""
    opens, closes = t == _OPEN, t == _CLOSE
    depth_before = np.cumsum(opens.astype(np.int8) - closes.astype(np.int8), dtype=np.int64) - opens + closes
    prev = np.empty_like(t)
    prev[0] = 0
    prev[1:] = t[:-1]
    nxt = np.empty_like(t)
    nxt[-1] = 0
    nxt[:-1] = t[1:]
    inner = depth_before == 1
    comma = t == _COMMA
    ok = np.where(t == _S, (prev == _COMMA) & (nxt == _COLON) & ~inner, False)
    ok |= (t == _COLON) & (prev == _S) & (nxt == _OPEN)
    ok |= opens & (prev == _COLON) & ((nxt == _N) | (nxt == _CLOSE))
    ok |= (t == _N) & ((prev == _OPEN) | (prev == _COMMA)) & ((nxt == _COMMA) | (nxt == _CLOSE)) & inner
    ok |= closes & ((prev == _N) | (prev == _OPEN)) & ((nxt == _COMMA) | (nxt == 0)) & inner
    ok |= comma & ~inner & ((prev == _CLOSE) | (prev == 0)) & (nxt == _S)
    ok |= comma & inner & (prev == _N) & (nxt == _N)
    ok[0] &= (t[0] == _COMMA) and depth_before[0] == 0
    if not ok.all() or t[-1] != _CLOSE:
        raise _Unhandled
