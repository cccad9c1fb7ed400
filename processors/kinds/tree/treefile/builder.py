"""Checking and assembling a token tree as it is read (``processors/kinds/tree/treefile/load.py`` feeds it): :class:`_TreeBuilder`
takes a scanned file, a mapping or ijson events, checks every rule (keys, separator, candidate ids, duplicates,
the vocabulary) and returns a :class:`~processors.kinds.tree.treefile.data.TreeData`, or raises one
:class:`~processors.kinds.tree.treefile.data.TreeFileError` naming every problem found."""

from __future__ import annotations

import json
import logging
import re
from array import array
from collections import Counter
from collections.abc import Iterator, Mapping
from itertools import chain
from typing import Any

import numpy as np

from config.cancel import checkpoint
from processors.kinds.tree.treefile.scan import ScannedTree, ordered_map, parse_keys

from processors.kinds.tree.treefile.data import (
    _FOREIGN, _INT32_MAX, _PLACEHOLDER, _REQUIRED_FIELDS, DEFAULT_SEP, MAX_REPORTED_PROBLEMS, TOP_LEVEL_FIELDS, TreeData,
    TreeFileError, _Container, _describe, _is_int, _key_problem, _kref, _Problems, _sep_problem,
)

logger = logging.getLogger("processors.kinds.tree.treefile.load")

_KEY_BLOCK = 1 << 20  # keys per block when hashing a list of keys
_BLOB_BLOCK = 4 << 20  # bytes per block when hashing scanned keys
_HASHABLE_SEP = re.compile(r"[^\x00\x01]+")


class _TreeBuilder:
    """Accumulates keys and candidates from a stream, a dict or a numpy scan, then checks the rules across
    fields. ``strict``: refuse what a lenient load accepts with a warning (see :func:`load_tree`)."""

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self.fields: dict[str, Any] = {}
        self.keys: list[Any] | None = []
        self.key_blocks: list[bytes] | None = None
        self.offsets = array("q", [0])
        self.candidates = array("q")
        self.huge: dict[int, int] = {}  # candidate position -> an id beyond int64 (a placeholder is stored)
        self.unknown: list[Any] = []
        self.problems = _Problems()
        self._offsets_np: np.ndarray | None = None
        self._candidates_np: np.ndarray | None = None
        self._max_key_part = -2

    # -- input from a numpy scan (processors.kinds.tree.treefile.scan) -----------------------------------------------------------
    def add_scan(self, scan: ScannedTree) -> None:
        for name in scan.duplicate_fields:
            self.problems.add(f"duplicate top-level field {json.dumps(name)}")
        for name, value in scan.fields.items():
            if name in TOP_LEVEL_FIELDS:
                self.fields[name] = value
            else:
                self._unknown_field(name)
        self.keys = None
        self.key_blocks = scan.key_blocks
        offsets = np.zeros(scan.counts.size + 1, dtype=np.int64)
        np.cumsum(scan.counts, out=offsets[1:])
        self._offsets_np, self._candidates_np = offsets, scan.candidates

    # -- input from a mapping ---------------------------------------------------------------------------------
    def add_mapping(self, data: Mapping[str, Any]) -> None:
        for name, value in data.items():
            if name not in TOP_LEVEL_FIELDS:
                self._unknown_field(name)
            elif name == "prefix_dict":
                self.fields[name] = True
                if isinstance(value, Mapping):
                    if not self._add_fast(value):
                        for key, cands in value.items():
                            self._add_entry(key, cands)
                else:
                    self.problems.add(f"prefix_dict: must be an object mapping keys to lists, got {_describe(value)}")
            else:
                self.fields[name] = value

    def _add_fast(self, prefix: Mapping[str, Any]) -> bool:
        """Take a prefix dict whose keys are all strings and values all lists of plain ints (the common case) with
        C-level passes; False (nothing taken) when anything else is in it: then :meth:`_add_entry` names it."""
        keys = list(prefix.keys())
        values = list(prefix.values())
        if set(map(type, keys)) - {str} or set(map(type, values)) - {list}:
            return False
        flat = chain.from_iterable(values)
        if set(map(type, flat)) - {int}:  # bools, floats, strings, ... (and ints past int64 fail below)
            return False
        try:
            candidates = array("q", chain.from_iterable(values))
        except OverflowError:
            return False
        counts = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
        offsets = np.zeros(len(values) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        assert self.keys is not None and not self.keys and len(self.candidates) == 0
        self.keys.extend(keys)
        self.candidates = candidates
        self.offsets = array("q", offsets.tobytes())
        return True

    def _add_entry(self, key: Any, cands: Any) -> None:
        if not isinstance(key, str):
            self.problems.add(f"{_kref(key)}: key must be a string, got {_describe(key)}")
        assert self.keys is not None
        self.keys.append(key)
        if isinstance(cands, (list, tuple, np.ndarray)):
            append = self.candidates.append
            for i, value in enumerate(cands):
                if _is_int(value):
                    try:
                        append(int(value))
                    except OverflowError:
                        self.huge[len(self.candidates)] = int(value)
                        append(_PLACEHOLDER)
                    continue
                self.problems.add(f"{_kref(key)}[{i}]: candidate must be an integer, got {_describe(value)}")
                append(_PLACEHOLDER)
        else:
            self.problems.add(f"{_kref(key)}: candidates must be a list of integers, got {_describe(cands)}")
        self.offsets.append(len(self.candidates))

    def _unknown_field(self, name: Any) -> None:
        self.unknown.append(name)

    # -- input from an ijson event stream ---------------------------------------------------------------------
    def add_events(self, events: Iterator[tuple[str, Any]]) -> None:
        first = next(events, None)
        if first is None:
            raise TreeFileError(["the file contains no JSON value"])
        if first[0] != "start_map":
            got = _describe(_event_value(*first, events))
            raise TreeFileError([f"the top level must be a JSON object, got {got}"])
        for event, name in events:
            if event == "end_map":
                break
            if name in self.fields:
                self.problems.add(f"duplicate top-level field {json.dumps(name)}")
            if name == "prefix_dict":
                self.fields[name] = True
                self._stream_prefix_dict(events)
            else:
                value = _event_value(*next(events), events)
                if name in TOP_LEVEL_FIELDS:
                    self.fields[name] = value
                else:
                    self._unknown_field(name)
        if next(events, None) is not None:  # yajl raises on trailing data; this is a second guard
            self.problems.add("unexpected content after the top-level object")

    def _stream_prefix_dict(self, events: Iterator[tuple[str, Any]]) -> None:
        event, value = next(events)
        if event != "start_map":
            value = _event_value(event, value, events)
            self.problems.add(f"prefix_dict: must be an object mapping keys to lists, got {_describe(value)}")
            return
        assert self.keys is not None
        keys_append = self.keys.append
        candidates = self.candidates
        cand_append = candidates.append
        offsets_append = self.offsets.append
        # Hot loop: one iteration per JSON event of a possibly huge file, so keep it free of function calls (but
        # for a stop check every 65,536 keys: config.cancel).
        n_keys = 0
        for event, key in events:
            if event == "end_map":
                return
            n_keys += 1
            if not n_keys & 0xFFFF:
                checkpoint()
            keys_append(key)
            event, value = next(events)
            if event == "start_array":
                begin = len(candidates)
                for event, value in events:
                    if event == "number" and type(value) is int:
                        try:
                            cand_append(value)
                        except OverflowError:
                            self.huge[len(candidates)] = value
                            cand_append(_PLACEHOLDER)
                    elif event == "end_array":
                        break
                    else:
                        value = _event_value(event, value, events)
                        index = len(candidates) - begin
                        self.problems.add(f"{_kref(key)}[{index}]: candidate must be an integer, got {_describe(value)}")
                        cand_append(_PLACEHOLDER)
            else:
                value = _event_value(event, value, events)
                self.problems.add(f"{_kref(key)}: candidates must be a list of integers, got {_describe(value)}")
            offsets_append(len(candidates))

    # -- rules across fields ----------------------------------------------------------------------------------
    def finish(self, vocab_size: int | None, source: str) -> TreeData:
        problems, strict = self.problems, self.strict
        warnings: list[str] = []
        for name in _REQUIRED_FIELDS:
            if name not in self.fields:
                problems.add(f"missing required field {json.dumps(name)}")
        expected = ", ".join(TOP_LEVEL_FIELDS)
        for name in self.unknown:
            if strict:
                problems.add(f"unknown top-level field {json.dumps(name)} (expected: {expected})")
            else:
                warnings.append(f"unknown top-level field {json.dumps(name)} ignored (expected: {expected})")
        ids = {name: self._check_id(name, vocab_size) for name in ("start_token_id", "end_token_id")}
        sep = self.fields.get("sep", DEFAULT_SEP)
        sep_problem = _sep_problem(sep, strict)
        if sep_problem:
            problems.add(sep_problem)
        elif "-" in sep:
            warnings.append(f"sep {json.dumps(sep)} contains '-' (accepted; strict: true refuses it)")
        offsets: np.ndarray = np.frombuffer(self.offsets, dtype=np.int64)
        candidates: np.ndarray = np.frombuffer(self.candidates, dtype=np.int64)
        if self._offsets_np is not None and self._candidates_np is not None:  # a numpy scan
            offsets, candidates = self._offsets_np, self._candidates_np
        n_keys = offsets.size - 1
        start = ids["start_token_id"]
        hashed: tuple[np.ndarray, np.ndarray, np.ndarray, int] | None = None
        blob: bytes | None = None
        if self.key_blocks is not None:
            blob = b"".join(self.key_blocks)
            self.key_blocks = None
        if start is not None and not sep_problem:
            hashed = self._check_keys(str(start), sep, vocab_size, blob, n_keys, warnings)
        offsets, candidates = self._check_candidates(offsets, candidates, vocab_size, blob, warnings)
        if problems.count:
            raise problems.error(source)
        if hashed is not None and hashed[3] < 0 or hashed is None and str(start) not in self._key_strings(blob):
            warnings.insert(0, f"no entry for the root key {str(start)!r}: the first step will force the end token")
        for message in warnings:
            logger.warning("%s: %s", source, message)
        offsets.flags.writeable = False
        candidates.flags.writeable = False
        end = ids["end_token_id"]
        assert start is not None and end is not None  # a missing id was reported as a problem above
        if hashed is None:
            return TreeData(start, end, sep, offsets, candidates, tuple(warnings), key_list=self.keys, key_blob=blob)
        h1, h2, targetable, root_index = hashed
        max_id = max(start, end, int(candidates.max()) if candidates.size else -1, self._max_key_part)
        return TreeData(start, end, sep, offsets, candidates, tuple(warnings), key_list=self.keys, key_blob=blob,
                        key_h1=h1, key_h2=h2, targetable=targetable, root_index=root_index,
                        max_id=max_id if self._max_key_part >= -1 else -1, strict=self.strict)

    def _key_strings(self, blob: bytes | None) -> list[Any]:
        if self.keys is None:
            assert blob is not None
            self.keys = blob.decode("utf-8", "surrogatepass").split("\x00")[:-1]
        return self.keys

    def _key_at(self, blob: bytes | None, ends: np.ndarray | None, i: int) -> Any:
        """Key ``i`` as a string, without building the whole list for a scanned file."""
        if self.keys is not None:
            return self.keys[i]
        assert blob is not None and ends is not None
        begin = int(ends[i - 1]) + 1 if i else 0
        return blob[begin : int(ends[i])].decode("utf-8", "surrogatepass")

    def _blocks(self, blob: bytes | None, sep: str) -> Iterator[np.ndarray]:
        """The keys in blocks for :func:`processors.kinds.tree.treefile.scan.parse_keys` (each ended by 0, the separator as 1)."""
        if blob is not None:  # a scanned file: printable ASCII only, so 0 and 1 occur nowhere else
            sep_bytes = sep.encode("utf-8")
            view = memoryview(blob)
            lo = 0
            while lo < len(blob):  # blocks of about _BLOB_BLOCK bytes, cut after a key's end
                hi = blob.find(b"\x00", min(lo + _BLOB_BLOCK, len(blob) - 1)) + 1
                if len(sep_bytes) == 1:
                    mapped = np.frombuffer(view[lo:hi], dtype=np.uint8).copy()
                    mapped[mapped == sep_bytes[0]] = 1
                    yield mapped
                else:
                    yield np.frombuffer(bytes(view[lo:hi]).replace(sep_bytes, b"\x01"), dtype=np.uint8)
                lo = hi
            if not blob:
                yield np.zeros(0, dtype=np.uint8)
            return
        keys = self.keys
        assert keys is not None
        if not keys:
            yield np.zeros(0, dtype=np.uint8)
        for lo in range(0, len(keys), _KEY_BLOCK):
            part = [k if isinstance(k, str) else "\x7f" for k in keys[lo : lo + _KEY_BLOCK]]
            text = "\x00".join(part) + "\x00"
            if text.count("\x00") != len(part) or "\x01" in text:  # such keys get the exact check
                part = [k.replace("\x00", "\x7f").replace("\x01", "\x7f") for k in part]
                text = "\x00".join(part) + "\x00"
            yield np.frombuffer(text.replace(sep, "\x01").encode("utf-8", "surrogatepass"), dtype=np.uint8)

    def _check_keys(self, root: str, sep: str, vocab_size: int | None, blob: bytes | None, n_keys: int,
                    warnings: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, int] | None:
        """Key rules; returns ``(h1, h2, targetable, root_index)``, or None for a separator that holds 0 or 1
        (those keys are checked one by one and compiled by their strings)."""
        if not _HASHABLE_SEP.fullmatch(sep) or "\x7f" in sep:
            self._check_keys_by_string(root, sep, vocab_size, blob, warnings)
            self._check_duplicates_by_string(blob)
            return None
        blocks = list(ordered_map(lambda block: parse_keys(block, vocab_size), self._blocks(blob, sep)))
        odd = np.concatenate([b.odd for b in blocks])
        first = np.concatenate([b.first for b in blocks])
        n_parts = np.concatenate([b.n_parts for b in blocks])
        over_vocab = np.concatenate([b.over_vocab for b in blocks])
        max_later = np.concatenate([b.max_later for b in blocks])
        h1 = np.concatenate([b.h1 for b in blocks])
        h2 = np.concatenate([b.h2 for b in blocks])
        del blocks
        assert h1.size == n_keys, (h1.size, n_keys)
        ends = np.flatnonzero(np.frombuffer(blob, dtype=np.uint8) == 0) if blob is not None else None
        start = int(root)
        rooted = ~odd & (first == start)
        # the largest part of a key under the root; -2: some key under the root was not read as numbers
        self._max_key_part = int(max_later[rooted].max()) if rooted.any() else -1
        foreign = np.flatnonzero(~odd & (first != start)).tolist()
        # keys that are not canonical decimal parts: the exact check decides (malformed, foreign, or fine)
        for i in np.flatnonzero(odd).tolist():
            key = self._key_at(blob, ends, i)
            problem = _key_problem(key, root, sep, vocab_size)
            if problem == _FOREIGN:
                foreign.append(i)
                continue
            self._max_key_part = -2
            if problem:
                self.problems.add(f"{_kref(key)}: {problem}")
        if foreign:
            foreign.sort()
            if self.strict:
                for i in foreign:
                    self.problems.add(f"{_kref(self._key_at(blob, ends, i))}: key must be {root!r} or start with "
                                      f"{(root + sep)!r}")
            else:
                shown = ", ".join(_kref(self._key_at(blob, ends, i)) for i in foreign[:3])
                warnings.append(f"{len(foreign)} key(s) do not start with the root {root!r} and are never reached "
                                f"(kept, unused): {shown}{', ...' if len(foreign) > 3 else ''}")
        if vocab_size is not None and not self.problems.count:
            for i in np.flatnonzero(over_vocab & rooted)[: MAX_REPORTED_PROBLEMS + 1].tolist():
                key = self._key_at(blob, ends, i)
                self.problems.add(f"{_kref(key)}: {_key_problem(key, root, sep, vocab_size)}")
            self.problems.count += max(0, int(np.count_nonzero(over_vocab & rooted)) - MAX_REPORTED_PROBLEMS - 1)
        # duplicates: equal hashes, confirmed on the strings (only keys whose hash repeats are compared)
        sorted_h1 = np.sort(h1[~odd])
        repeated = np.unique(sorted_h1[1:][sorted_h1[1:] == sorted_h1[:-1]])
        suspects = np.flatnonzero(np.isin(h1, repeated) & ~odd).tolist() if repeated.size else []
        suspects += np.flatnonzero(odd).tolist()
        if suspects:
            counts = Counter(self._key_at(blob, ends, i) for i in suspects)
            for key, count in counts.items():
                if count > 1:
                    self.problems.add(f"{_kref(key)}: duplicate key (appears {count} times)")
        roots = np.flatnonzero(rooted & (n_parts == 1))
        h1.flags.writeable = h2.flags.writeable = rooted.flags.writeable = False
        return h1, h2, rooted, int(roots[0]) if roots.size else -1

    def _check_keys_by_string(self, root: str, sep: str, vocab_size: int | None, blob: bytes | None,
                              warnings: list[str]) -> None:
        foreign = []
        for key in self._key_strings(blob):
            problem = _key_problem(key, root, sep, vocab_size)
            if problem == _FOREIGN:
                foreign.append(key)
            elif problem:
                self.problems.add(f"{_kref(key)}: {problem}")
        if foreign and self.strict:
            for key in foreign:
                self.problems.add(f"{_kref(key)}: key must be {root!r} or start with {(root + sep)!r}")
        elif foreign:
            warnings.append(f"{len(foreign)} key(s) do not start with the root {root!r} and are never reached "
                            f"(kept, unused): {', '.join(_kref(k) for k in foreign[:3])}")

    def _check_duplicates_by_string(self, blob: bytes | None) -> None:
        keys = self._key_strings(blob)
        hashes = np.fromiter(map(hash, keys), dtype=np.int64, count=len(keys))
        hashes.sort()
        repeated = hashes[1:][hashes[1:] == hashes[:-1]]
        if not repeated.size:
            return
        suspects = set(repeated.tolist())
        counts = Counter(key for key in keys if hash(key) in suspects)
        for key, count in counts.items():
            if count > 1:
                self.problems.add(f"{_kref(key)}: duplicate key (appears {count} times)")

    def _check_id(self, name: str, vocab_size: int | None) -> int | None:
        if name not in self.fields:
            return None
        value = self.fields[name]
        if not _is_int(value):
            self.problems.add(f"{name}: must be an integer, got {_describe(value)}")
        elif value < 0:
            self.problems.add(f"{name}: id {value} is negative")
        elif vocab_size is not None and value >= vocab_size:
            self.problems.add(f"{name}: id {value} is out of range for vocab_size {vocab_size}")
        else:
            return int(value)
        return None

    def _check_candidates(self, offsets: np.ndarray, candidates: np.ndarray, vocab_size: int | None,
                          blob: bytes | None, warnings: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Candidate rules; a lenient load skips negative ids and ids beyond int32 (as RTP-LLM does). Returns the
        offsets and candidates to keep."""
        ends = np.flatnonzero(np.frombuffer(blob, dtype=np.uint8) == 0) if blob is not None else None

        def where(pos: int) -> str:
            row = int(np.searchsorted(offsets, pos, side="right")) - 1
            return f"{_kref(self._key_at(blob, ends, row))}[{pos - int(offsets[row])}]"

        huge = np.zeros(candidates.size, dtype=bool)
        if self.huge:
            huge[list(self.huge)] = True
        negative = candidates < 0
        if self.strict:
            checks = [(negative, "is negative"), (huge, "is too large")]
        else:
            skip = negative | huge | (candidates > _INT32_MAX)
            checks = []
            n_skip = int(np.count_nonzero(skip))
            if n_skip:
                positions = np.flatnonzero(skip)
                shown = ", ".join(f"{where(p)} = {self.huge.get(p, int(candidates[p]))}" for p in positions[:3].tolist())
                warnings.append(f"{n_skip} candidate id(s) negative or beyond int32 skipped: {shown}"
                                f"{', ...' if n_skip > 3 else ''}")
        if vocab_size is not None:
            checks.append((~huge & (candidates >= vocab_size) if self.strict else ~skip & (candidates >= vocab_size),
                           f"is out of range for vocab_size {vocab_size}"))
        for bad, reason in checks:
            positions = np.flatnonzero(bad)
            if not positions.size:
                continue
            for pos in positions[:MAX_REPORTED_PROBLEMS].tolist():
                self.problems.add(f"{where(pos)}: id {self.huge.get(pos, int(candidates[pos]))} {reason}")
            self.problems.count += max(0, positions.size - MAX_REPORTED_PROBLEMS)
        if self.strict or not n_skip:
            return offsets, candidates
        row = np.searchsorted(offsets, np.flatnonzero(skip), side="right") - 1
        kept_per_row = np.diff(offsets) - np.bincount(row, minlength=offsets.size - 1)
        new_offsets = np.zeros_like(offsets)
        np.cumsum(kept_per_row, out=new_offsets[1:])
        return new_offsets, candidates[~skip]


def _event_value(event: str, value: Any, events: Iterator[tuple[str, Any]]) -> Any:
    """Turn one ijson event into a scalar, or skip a whole container and return a :class:`_Container`."""
    if event not in ("start_map", "start_array"):
        return value
    depth = 1
    for inner, _ in events:
        if inner in ("start_map", "start_array"):
            depth += 1
        elif inner in ("end_map", "end_array"):
            depth -= 1
            if depth == 0:
                break
    return _Container("object" if event == "start_map" else "array")


